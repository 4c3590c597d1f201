"""Qwen2, Qwen3, Gemma 3 and OLMo 3 in and out of Hugging Face (longctx/interop/families.py).

The fixtures (tests/assets/hf/{qwen3,qwen2_window,gemma3,olmo3}, made by make_fixtures.py with
transformers 5.24) are tiny random models with both layer types where the family has them:
Qwen2 full, full, sliding, sliding (from max_window_layers); Gemma 3 sliding, sliding, full,
sliding (a period of 3 and a remainder, two RoPEs: theta 10,000 and 1,000,000 with linear x8, a
query scale of query_pre_attn_scalar=24); OLMo 3 three sliding to one full (YaRN on the full
layer only). Converted, each must give transformers' float32 logits within 1e-4 on the ring
(sp=4, zigzag), with both attention impls, and go back to the same tensors bit for bit and a
config.json of the same class and layer_types. In bfloat16 their logits must be no further from
transformers' float32 ones than transformers' own bfloat16 logits are.
"""

import json
import os
import shlex

import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.evals import inference
from longctx.interop import families, hf
from tests import ROOT as REPO
from tests.interop.test_check_logits import run_script
from tests.validate_commands import run_scripts
from tests.interop.test_hf import (ASSETS, RING, assert_logits_match_transformers, convert, converted_config,
                                   golden_rows)

FAMILY_MODELS = ("qwen3", "qwen2_window", "gemma3", "olmo3")
# The config.json keys an export must give back as the source has them.
SAME_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
             "tie_word_embeddings", "sliding_window", "layer_types", "bos_token_id", "eos_token_id",
             "hidden_act", "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
             "attn_logit_softcapping", "use_sliding_window", "max_window_layers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: convert(os.path.join(ASSETS, name), str(root / name)) for name in FAMILY_MODELS}


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_logits_match_transformers(name, converted):
    assert_logits_match_transformers(converted[name], name)


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_logits_in_bfloat16_are_no_further_from_float32_than_transformers_own(name, converted):
    """model.dtype=bfloat16 (with Gemma's embedding scale rounded to it, as transformers rounds it):
    the logits' RMS distance from transformers' float32 logits is at most that of transformers' own
    bfloat16 logits (golden_logits_bf16.npz: the stored models read in bfloat16), on the same rows."""
    runner = inference.runner_from_checkpoint(converted[name], {**RING, "model.dtype": "bfloat16"})
    inputs, golden, where = golden_rows()
    logits = runner.logits_at(inputs, where)
    transformers_bf16 = np.load(os.path.join(ASSETS, "golden_logits_bf16.npz"))[name]
    rms = lambda x: float(np.sqrt(np.mean(np.square(x - golden[name]))))  # noqa: E731
    print(f"{name}: RMS from float32, longctx bfloat16 {rms(logits):.3g}, transformers bfloat16 "
          f"{rms(transformers_bf16):.3g}")
    assert 0 < rms(logits) <= rms(transformers_bf16)


@pytest.mark.parametrize("name, wrong", [
    ("gemma3", {"model.query_pre_attn_scalar": None}),  # head_dim ** -0.5, Llama's query scale
    ("gemma3", {"attention.layer_types.sliding.rope_theta": 1_000_000.0}),  # the full layers' theta
    ("olmo3", {"model.qk_norm": "per_head", "model.norm_position": "sandwich"}),
])
def test_logit_check_has_teeth(name, wrong, converted):
    """One family choice read wrongly moves the logits far beyond the tolerance."""
    if "model.qk_norm" in wrong:  # (another parameter tree: build it from the config, not the checkpoint)
        config = converted_config(os.path.join(ASSETS, name), **wrong)
        with pytest.raises(ConfigError, match="has no tensor model.layers.0.input_layernorm.weight"):
            inference.make_runner(config, lambda a, s: hf.load_params(os.path.join(ASSETS, name), config, a, s))
        return
    runner = inference.runner_from_checkpoint(converted[name], {**RING, **wrong})
    inputs, golden, where = golden_rows()
    assert float(np.abs(runner.logits_at(inputs, where) - golden[name]).max()) > 1e-2


@pytest.mark.parametrize("name", FAMILY_MODELS)
def test_round_trip_is_bit_identical_with_the_same_config(name, converted, tmp_path):
    """HF -> longctx -> HF: every tensor equal bit for bit, none added or lost, and the config.json
    keys that define the model as the source has them (its class, layer_types, window, RoPE)."""
    runner = inference.runner_from_checkpoint(converted[name], RING)
    with open(os.path.join(ASSETS, name, "config.json")) as f:
        source_config = json.load(f)
    out = str(tmp_path / "hf")
    hf.write_hf(runner.params, runner.config, out, dtype=np.float32, template=source_config)
    source = dict(hf.iter_hf_tensors(os.path.join(ASSETS, name)))
    again = dict(hf.iter_hf_tensors(out))
    assert sorted(again) == sorted(source)
    for key, value in source.items():
        assert again[key].dtype == value.dtype and again[key].shape == value.shape, key
        assert again[key].tobytes() == value.tobytes(), key
    exported = hf.read_config(out)
    for key in SAME_KEYS:
        assert exported.get(key) == source_config.get(key), key
    if families.FAMILIES[source_config["architectures"][0]].rope_per_type:
        # (YaRN's defaults written out too: beta_fast, beta_slow, truncate)
        for layer_type, rope in source_config["rope_parameters"].items():
            assert rope.items() <= exported["rope_parameters"][layer_type].items(), layer_type
    # ... and read back, the same longctx model (YaRN's defaults now written out)
    read_back = [base.get_config() for _ in range(2)]
    config_lib.apply_overrides(read_back[0], hf.config_overrides(exported))
    config_lib.apply_overrides(read_back[1], hf.config_overrides(source_config))
    assert read_back[0].to_dict() == read_back[1].to_dict()
    # An export from a training config that names no template: the same class and layer types.
    bare = hf.export_config(runner.config, np.float32)
    assert bare["architectures"] == source_config["architectures"]
    assert bare.get("layer_types") == source_config.get("layer_types")


@pytest.mark.parametrize("name", [name if name in ("gemma3", "olmo3") else pytest.param(name, marks=pytest.mark.skipif(
    not os.environ.get("LONGCTX_EXHAUSTIVE"), reason="the Qwen models on splash run with LONGCTX_EXHAUSTIVE=1 "
    "(both layer types and per-head and whole QK-norm are checked on splash by Gemma 3 and OLMo 3; the Qwen "
    "logits on the xla ring by test_logits_match_transformers)")) for name in FAMILY_MODELS])
def test_check_logits_on_the_splash_ring(name, converted, tmp_path):
    """scripts/convert_hf.py check-logits with the splash kernel (interpret mode) on sp=4: rows
    padded to 1,024 tokens, the kernel's 128-token blocks (the xla ring: test_logits_match_transformers)."""
    inputs = dict(np.load(os.path.join(ASSETS, "inputs.npz")))
    golden = np.load(os.path.join(ASSETS, "golden_logits.npz"))
    ids = str(tmp_path / "ids.npz")
    np.savez(ids, **inputs, logits=golden[name], positions_index=golden["positions_index"])
    done = run_script("check-logits", f"--checkpoint={converted[name]}", f"--tokens={ids}", "--mesh=1,2,4",
                      "--impl=splash")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "attention impl splash (block 128)" in done.stdout and "'sp': 4" in done.stdout
    assert ": OK" in done.stdout, done.stdout
    print(done.stdout.strip().splitlines()[-1])


def fixture_config(name):
    return hf.read_config(os.path.join(ASSETS, name))


def without(hf_config, *keys):
    return {k: v for k, v in hf_config.items() if k not in keys}


@pytest.mark.parametrize("name, older", [
    # Qwen2/3 before layer_types: use_sliding_window + max_window_layers (layers from 2 on slide)
    ("qwen2_window", lambda c: without(c, "layer_types")),
    # Gemma 3 before layer_types and per-type rope_parameters (transformers 4.x, released configs)
    ("gemma3", lambda c: {**without(c, "layer_types", "rope_parameters", "_sliding_window_pattern"),
                          "sliding_window_pattern": 3, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    # OLMo 3 with its fixed 3:1 pattern and the scaling of its full layers as rope_scaling
    ("olmo3", lambda c: {**without(c, "layer_types", "rope_parameters"), "rope_theta": 500_000.0,
                         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}),
])
def test_older_spellings_read_as_the_same_model(name, older):
    source = fixture_config(name)
    assert hf.config_overrides(older(source)) == hf.config_overrides(source)


def test_the_layer_types_become_a_period_with_each_types_window_and_rope():
    gemma = hf.config_overrides(fixture_config("gemma3"))
    assert gemma["attention.pattern"] == "sliding,sliding,full"  # 4 layers: the last is the remainder's
    assert gemma["attention.layer_types"] == {
        "sliding": {"sliding_window": 99, "rope_theta": 10_000.0, "rope_scaling": {"type": "none"}}, "full": {}}
    assert (gemma["model.rope_theta"], gemma["model.rope_scaling.type"]) == (1_000_000.0, "linear")
    assert gemma["model.query_pre_attn_scalar"] == 24.0 and gemma["model.mlp_activation"] == "gelu_tanh"
    olmo = hf.config_overrides(fixture_config("olmo3"))
    assert olmo["attention.pattern"] == "sliding,sliding,sliding,full"
    assert olmo["attention.layer_types"]["sliding"]["rope_scaling"] == {"type": "none"}  # YaRN on full only
    qwen2 = hf.config_overrides(fixture_config("qwen2_window"))
    assert qwen2["attention.pattern"] == "full,full,sliding,sliding"
    assert qwen2["attention.layer_types"]["sliding"] == {"sliding_window": 99}  # one RoPE for both
    no_window = hf.config_overrides({**without(fixture_config("qwen2_window"), "layer_types"),
                                     "use_sliding_window": False})
    assert no_window["attention.pattern"] == "" and no_window["attention.sliding_window"] is None
    assert families.shortest_period(["a", "a", "b", "a", "a", "b", "a"]) == ["a", "a", "b"]


def test_printed_overrides_set_the_converted_model_through_the_flags(tmp_path):
    """What to-longctx prints (and writes to config_overrides.txt) is a train.py command line:
    the layer types dict as one quoted flag."""
    overrides = hf.config_overrides(fixture_config("gemma3"))
    flags = hf.print_overrides(overrides, base=base.get_config())
    assert "\"--config.attention.layer_types={'sliding': {'sliding_window': 99" in flags
    train = [os.path.join(REPO, "scripts", "train.py"), "--config=configs/base.py", f"--workdir={tmp_path}",
             "--config.mesh.sp=8", "--config.data.seq_len=8192", "--validate_only"]
    done = run_scripts([train + shlex.split(flags.replace("\\\n", " "))], cwd=REPO,
                       env={"LONGCTX_CPU_DEVICES": "8"})[0]
    assert done["returncode"] == 0, done["stderr"]
    # ... and a flag of the period the converted model lacks is the flag parser's refusal, not ignored
    done = run_scripts([train + shlex.split(flags.replace("\\\n", " ").replace("sliding,sliding,full", "sliding,local"))],
                       cwd=REPO, env={"LONGCTX_CPU_DEVICES": "8"})[0]
    assert done["returncode"] == 2 and "layer type 'local'" in done["stderr"], done["stderr"]


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128},
     r"Qwen3MoeForCausalLM is a mixture-of-experts model and longctx's MLP is dense: convert a dense model"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "vision_config": {}},
     r"Gemma3ForConditionalGeneration holds vision/audio towers that longctx does not have: convert its text model"),
    ({"layer_types": ["chunked_attention"] * 2}, r"layer type 'chunked_attention' is not supported"),
    ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
])
def test_unsupported_fields_are_one_sentence(change, message):
    with pytest.raises(ConfigError, match=message) as raised:
        hf.config_overrides({**fixture_config("qwen3"), **change}, "x/config.json")
    assert str(raised.value).startswith("x/config.json: ") and str(raised.value).count(". ") == 0


def test_an_encoder_gemma_is_refused():
    with pytest.raises(ConfigError, match="use_bidirectional_attention=true"):
        hf.config_overrides({**fixture_config("gemma3"), "use_bidirectional_attention": True})


def test_export_refuses_what_no_family_has_in_one_sentence():
    config = converted_config(os.path.join(ASSETS, "qwen3"), **{"model.norm_position": "sandwich"})
    with pytest.raises(ConfigError, match=r"^a model with block options .*'norm_position': 'sandwich'.* is none "
                       r"of the Hugging Face families longctx exports"):
        hf.export_config(config, np.float32)
    gemma = converted_config(os.path.join(ASSETS, "gemma3"))
    config_lib.apply_overrides(gemma, {"attention.layer_types": {
        "sliding": dict(gemma.attention.layer_types.sliding), "full": {"sliding_window": 49}}})
    with pytest.raises(ConfigError, match=r"^sliding windows \[49, 99\] on different layer types"):
        hf.export_config(gemma, np.float32)
