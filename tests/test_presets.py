"""The presets agree with themselves: none draws a start-up note about its own settings."""

import numpy as np
import pytest

from configs import base
from longctx.train import optimizer


@pytest.mark.parametrize("preset", sorted(base.PRESETS))
def test_no_preset_has_a_warmup_longer_than_its_run(preset):
    """long_cpu (4 steps) inherited tiny's 10 warmup steps, and every run of it began with a note
    that the warmup was cut to the run."""
    config = base.get_config(preset)
    notes = optimizer.optimizer_notes(config)
    assert not [note for note in notes if "warmup_steps" in note], notes


def test_long_cpu_learning_rates_are_what_they_were():
    """Its warmup now says what the schedule did with tiny's 10 steps: the same rate at every
    update, so the figures measured with it (docs/long_context.md) still hold."""
    config = base.get_config("long_cpu")
    before = base.get_config("long_cpu")
    before.unlock()
    before.optimizer.warmup_steps = 10
    updates = np.arange(config.train.num_steps + 1)
    np.testing.assert_array_equal(optimizer.learning_rate_schedule(config)(updates),
                                  optimizer.learning_rate_schedule(before)(updates))


# The released config.json of each family preset's model (the fields that define it), with the
# context extension its preset trains at (Qwen3-8B's model card: YaRN x4 over 32,768 tokens).
RELEASED = {
    "qwen3_8b_128k": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "olmo3_7b_64k": {
        "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 65536,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
        "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 100278,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}},
    "gemma3_12b_128k": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840, "intermediate_size": 15360,
        "max_position_embeddings": 131072, "num_attention_heads": 16, "num_hidden_layers": 48,
        "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "sliding_window": 1024,
        "sliding_window_pattern": 6, "tie_word_embeddings": True, "vocab_size": 262208,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_a_family_preset_is_the_model_its_config_json_converts_to(preset):
    """Validated for its v5p-128 slice (64 chips, sp=16), and the model (block options, shapes, each layer's
    window and RoPE) is what scripts/convert_hf.py makes of the released config.json."""
    from longctx import config as config_lib
    from longctx.interop import hf
    from longctx.model import layer_types

    config = base.get_config(preset)
    assert config_lib.validate(config, num_devices=64)["sp"] == 16  # v5p-128: 64 chips
    converted = base.get_config(preset)
    config_lib.apply_overrides(converted, hf.config_overrides(RELEASED[preset]))
    assert converted.model.to_dict() == config.model.to_dict()

    def layers(c):
        return [(t.attention.sliding_window, t.rotary) for t in layer_types.period(c)]

    assert layers(converted) == layers(config)

    def positions_by_type(c):  # the pattern up to the types' names (the converter's: sliding, full)
        names = layer_types.pattern(c.attention)
        return sorted(tuple(i for i, n in enumerate(names) if n == name) for name in set(names))

    assert positions_by_type(converted) == positions_by_type(config)


def test_qwen3_without_its_extension_differs_from_the_preset_by_the_scaling_alone():
    """docs/extend.md: to-longctx --config=configs/base.py:qwen3_8b_128k on the released
    Qwen3-8B prints one override, the YaRN scaling the preset adds."""
    from longctx.interop import hf

    native = {k: v for k, v in RELEASED["qwen3_8b_128k"].items() if k != "rope_scaling"}
    flags = hf.print_overrides(hf.config_overrides(native), base=base.get_config("qwen3_8b_128k"))
    assert flags == "--config.model.rope_scaling.type=none"
