"""RoPE scaling against transformers' own rotary embedding, and the rules on model.rope_scaling.

tests/assets/hf/rope_golden.json holds, for config.json excerpts in both spellings (`rope_theta` +
`rope_scaling` as in released Llama-3.1 checkpoints, `rope_parameters` as transformers 5 writes),
the inverse frequencies and cos/sin scale that transformers' LlamaRotaryEmbedding computed
(tests/assets/hf/make_fixtures.py, versions in versions.json). longctx reads the same excerpts
the way the converter does and must give the same float32 frequencies: equal, or one unit in
the last place where torch's float32 pow is not correctly rounded (theta 1e6, one frequency).
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.interop import hf
from longctx.model import rope
from longctx.model.decoder import apply_rope
from tests import ASSETS

GOLDEN = json.load(open(os.path.join(ASSETS, "hf", "rope_golden.json")))


def scaling_for(hf_config: dict, name: str):
    """(head_dim, theta, the full model.rope_scaling section) as the converter would set them."""
    theta, scaling = hf.rope_settings(hf_config, name)
    config = base.get_config()
    config_lib.apply_overrides(config, {f"model.rope_scaling.{k}": v for k, v in scaling.items()})
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    return head_dim, theta, config.model.rope_scaling


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_inverse_frequencies_match_transformers(name):
    case = GOLDEN[name]
    head_dim, theta, scaling = scaling_for(case["config"], name)
    got = rope.rotary(head_dim, theta, scaling)
    expected = np.asarray(case["inv_freq"], np.float32)
    assert got.inv_freq.dtype == np.float32 and got.inv_freq.shape == expected.shape
    ulps = np.abs(got.inv_freq.view(np.int32) - expected.view(np.int32))
    assert ulps.max() <= 1, f"{name}: frequencies {np.nonzero(ulps > 1)[0]} differ by up to {ulps.max()} ulp"
    assert got.attention_scaling == pytest.approx(case["attention_scaling"], rel=1e-12, abs=0)


def test_golden_cases_cover_every_type_and_both_spellings():
    kinds = {scaling_for(c["config"], n)[2].type for n, c in GOLDEN.items()}
    assert kinds == set(rope.ROPE_TYPES)
    assert any("rope_parameters" in c["config"] for c in GOLDEN.values())
    assert any("rope_scaling" in c["config"] for c in GOLDEN.values())
    # The two spellings of Llama-3.1-8B's RoPE give the same frequencies.
    a = rope.rotary(*scaling_for(GOLDEN["llama3_llama31_8b"]["config"], "a"))
    b = rope.rotary(*scaling_for(GOLDEN["llama3_llama31_8b_rope_parameters"]["config"], "b"))
    np.testing.assert_array_equal(a.inv_freq, b.inv_freq)


def test_scaling_is_a_real_change():
    """Each type moves the low frequencies (what extension is for) and keeps the highest one."""
    for name in ("linear_factor4", "llama3_llama31_8b", "yarn_factor4"):
        head_dim, theta, scaling = scaling_for(GOLDEN[name]["config"], name)
        plain = rope.plain_inv_freq(head_dim, theta)
        got = rope.rotary(head_dim, theta, scaling).inv_freq
        assert got[-1] <= plain[-1] / 4, name
        assert got[0] == plain[0] or name == "linear_factor4", name


def test_apply_rope_scales_cos_and_sin_like_transformers():
    """Rotate-half convention and YaRN's cos/sin scale, against the formula transformers uses:
    q * cos + rotate_half(q) * sin with cos = cos(angle) * s, sin = sin(angle) * s."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
    positions = rng.integers(0, 5000, (2, 9)).astype(np.int32)
    rotary = rope.Rotary(rope.plain_inv_freq(16, 10_000.0), attention_scaling=1.3)
    angles = positions[..., None].astype(np.float64) * rotary.inv_freq.astype(np.float64)
    emb = np.concatenate([angles, angles], -1)[:, :, None, :]
    half = np.concatenate([-x[..., 8:], x[..., :8]], -1)
    expected = x * np.cos(emb) * 1.3 + half * np.sin(emb) * 1.3
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), rotary))
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3)  # float32 angles up to 5000 rad


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn"])
def test_hf_spelling_round_trips(kind):
    name = {"linear": "linear_factor4", "llama3": "llama3_llama31_8b", "yarn": "yarn_betas_mscale"}[kind]
    _, _, scaling = scaling_for(GOLDEN[name]["config"], name)
    again = rope.from_hf(rope.to_hf(scaling), None, "exported")
    assert again == {k: scaling[k] for k in again}
    assert set(again) == {"type", *(k for k in rope.KEYS_BY_TYPE[kind] if scaling[k] is not None)}


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope type 'longrope'"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "has no 'low_freq_factor'"),
])
def test_unsupported_hf_rope_is_named(rope_scaling, message):
    with pytest.raises(ConfigError, match=message):
        rope.from_hf(rope_scaling, 8192, "config.json")


@pytest.mark.parametrize("overrides, message", [
    ({"type": "ntk"}, "model.rope_scaling.type='ntk' is not one of"),
    ({"type": "linear", "factor": 0.5}, "model.rope_scaling.factor=0.5 must be at least 1"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "model.rope_scaling.low_freq_factor=4.0 must be positive and below model.rope_scaling.high_freq_factor"),
    ({"type": "yarn", "factor": 4.0, "original_max_position": 0}, "model.rope_scaling.original_max_position=0"),
    ({"type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 32.0}, "model.rope_scaling.beta_slow=32.0"),
    ({"type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "model.rope_scaling.attention_factor=-1.0"),
])
def test_validate_names_the_rope_key(overrides, message):
    config = base.get_config("tiny")
    config.model.rope_scaling.update(overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_lib.validate(config, num_devices=8)


def test_presets_with_rope_scaling_validate():
    config = base.get_config("llama3_8b_extend_128k")
    assert config.model.rope_scaling.type == "llama3"
    assert config_lib.validate(config, num_devices=64)["sp"] == 16
