"""Makes the Hugging Face fixtures in this directory. Run once, in a venv of its own:

  python3 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
  /tmp/hfvenv/bin/python tests/assets/hf/make_fixtures.py

The tests read what it writes with numpy and longctx only (no torch, no transformers):

  <model>/config.json, <model>/model.safetensors   tiny random models saved by `save_pretrained`
                                                   (2 layers, d_model 64, 4 query / 2 KV heads,
                                                   vocab 512, float32; the Qwen2, Gemma 3 and
                                                   OLMo 3 ones 3-4 layers with both layer types)
  inputs.npz          two rows of 512 token ids: row 0 one document, row 1 three packed documents
                      (`segment_ids` 1..3, `positions` restarting at 0 in each)
  golden_logits.npz   per model, transformers' float32 logits of those rows at every
                      `LOGIT_STRIDE`-th position (row 1: each document run on its own, so its
                      positions restart as in longctx's packing); stored strided to keep the
                      fixture small, the positions still span the whole 512 tokens
  golden_logits_bf16.npz   the same for the family models (BF16_MODELS) read in bfloat16
                      (`make_fixtures.py --bf16-only` makes it from the stored models)
  rope_export_golden.json   what to-hf must write for linear / llama3 / YaRN models
                      (EXPORT_CASES) and transformers' reading of the sources and the exports,
                      per transformers version (`make_fixtures.py --rope-export-only` adds the
                      readings of the installed version: run it with 5.x and with 4.51.3)
  rope_golden.json    inverse frequencies and the cos/sin scale ("attention_scaling") computed by
                      transformers' own rotary embedding for HF config.json excerpts in both
                      spellings (`rope_theta` + `rope_scaling`, and `rope_parameters`)
  versions.json       the versions this ran with

Weights are drawn with a larger scale than HF's init (std 0.2 instead of 0.02) and the RMSNorm
gains are randomised, so that attention is far from uniform and logits are O(1): with HF's
default init every logit is ~0.1 and a RoPE or layout error would hide below the 1e-4 tolerance.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys

import numpy as np
import safetensors
import torch
import transformers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Olmo3Config, Olmo3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

HERE = os.path.dirname(os.path.abspath(__file__))
BF16_MODELS = ("qwen3", "qwen2_window", "gemma3", "olmo3")  # golden_logits_bf16.npz's
SEQ_LEN = 512
DOCS_ROW1 = (300, 150, 62)  # packed document lengths of row 1
LOGIT_STRIDE = 4

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, initializer_range=0.2)

MODELS = {
    "llama_untied": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10_000.0, tie_word_embeddings=False)),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10_000.0, tie_word_embeddings=True)),
    # original_max_position_embeddings=256 puts the 8 frequencies of head_dim 16 in all three of
    # llama3's bands (kept, smoothed, divided by the factor).
    "llama3_scaling": (LlamaConfig, LlamaForCausalLM, dict(
        rope_theta=500_000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256))),
    # A window shorter than the documents, so the window's exact width shows in the logits.
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(
        rope_theta=10_000.0, tie_word_embeddings=False, sliding_window=100)),
    # The families of tests/interop/test_families.py, each with the block options it needs
    # (longctx/model/block_options.py); head_dim 16 given, as their configs do.
    # Qwen3: QK-norm per head, RoPE theta 1,000,000, tied embeddings (the small sizes' choice).
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        tie_word_embeddings=True)),
    # Qwen2: q/k/v biases; layers from max_window_layers on slide (the older spelling, no
    # layer_types given): full, full, sliding, sliding.
    "qwen2_window": (Qwen2Config, Qwen2ForCausalLM, dict(
        num_hidden_layers=4, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=100, max_window_layers=2)),
    # Gemma 3 (text): sandwich norms with (1 + w) gains, GeGLU, embeddings x sqrt(d), a query
    # scale of query_pre_attn_scalar (24, not head_dim), QK-norm, and two layer types with their
    # own RoPE: sliding (window 100, theta 10,000) and full (theta 1,000,000, linear x8); 4 layers
    # of a period of 3, so the last is the remainder's.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=100, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=4, rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1_000_000.0)))),
    # OLMo 3: norms after the sublayers, QK-norm over the whole projection, 3 sliding (window
    # 100) to 1 full layer, YaRN on the full layers only.
    "olmo3": (Olmo3Config, Olmo3ForCausalLM, dict(
        num_hidden_layers=4, sliding_window=100, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
        max_position_embeddings=1024, rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=500_000.0),
            full_attention=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                                rope_theta=500_000.0)))),
}

# config.json excerpts for the RoPE golden values: released-model spellings and edge cases.
ROPE_CASES = {
    "default_theta10k_h16": dict(hidden_size=64, num_attention_heads=4, rope_theta=10_000.0),
    "default_llama3_8b": dict(hidden_size=4096, num_attention_heads=32, rope_theta=500_000.0,
                              max_position_embeddings=8192),
    "linear_factor4": dict(hidden_size=4096, num_attention_heads=32, rope_theta=10_000.0,
                           rope_scaling=dict(type="linear", factor=4.0)),
    # Llama-3.1-8B's config.json as released (legacy spelling).
    "llama3_llama31_8b": dict(hidden_size=4096, num_attention_heads=32, rope_theta=500_000.0,
                              max_position_embeddings=131_072,
                              rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192,
                                                rope_type="llama3")),
    # The same, as transformers 5 writes it.
    "llama3_llama31_8b_rope_parameters": dict(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131_072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama3_tiny_fixture": dict(hidden_size=64, num_attention_heads=4, rope_theta=500_000.0,
                                max_position_embeddings=2048,
                                rope_scaling=MODELS["llama3_scaling"][2]["rope_scaling"]),
    "yarn_factor4": dict(hidden_size=4096, num_attention_heads=32, rope_theta=10_000.0,
                         max_position_embeddings=16_384,
                         rope_scaling=dict(rope_type="yarn", factor=4.0,
                                           original_max_position_embeddings=4096)),
    "yarn_betas_mscale": dict(hidden_size=2048, num_attention_heads=16, rope_theta=1_000_000.0,
                              max_position_embeddings=131_072,
                              rope_parameters=dict(rope_type="yarn", rope_theta=1_000_000.0, factor=32.0,
                                                   original_max_position_embeddings=4096, beta_fast=16.0,
                                                   beta_slow=2.0, mscale=0.707, mscale_all_dim=0.707)),
    "yarn_attention_factor_no_truncate": dict(
        hidden_size=1024, num_attention_heads=8, rope_theta=10_000.0, max_position_embeddings=32_768,
        rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=8.0,
                             original_max_position_embeddings=4096, attention_factor=1.25,
                             truncate=False)),
    "yarn_no_original_max_position": dict(hidden_size=512, num_attention_heads=4, rope_theta=10_000.0,
                                          max_position_embeddings=4096,
                                          rope_scaling=dict(type="yarn", factor=2.0)),
}


# What `convert_hf.py to-hf` must write for RoPE-scaled models (tests/interop/test_hf.py exports each
# `source` in both spellings of the rope type, `type` and `rope_type`, after training at `seq_len`,
# and compares the exported fields with `exported`), and what transformers reads from both:
# rope_export_golden.json holds, per transformers version, the inverse frequencies and cos/sin
# scale of the source (both spellings) and of the export. "yarn_written_before" is the export
# longctx wrote before YaRN's max_position_embeddings was fixed to factor x original: transformers
# 4.4x-4.5x read YaRN's factor back as max_position_embeddings / original (8 here, not 4).
_SHAPE = dict(hidden_size=64, num_attention_heads=4)
EXPORT_CASES = {
    "linear": dict(
        seq_len=1024,
        source=dict(**_SHAPE, rope_theta=10_000.0, max_position_embeddings=2048,
                    rope_scaling=dict(rope_type="linear", factor=4.0)),
        exported=dict(**_SHAPE, head_dim=16, rope_theta=10_000.0, max_position_embeddings=2048,
                      rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama3": dict(
        seq_len=4096,
        source=dict(**_SHAPE, rope_theta=500_000.0, max_position_embeddings=2048,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=256)),
        exported=dict(**_SHAPE, head_dim=16, rope_theta=500_000.0, max_position_embeddings=4096,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=256))),
    "yarn": dict(
        seq_len=32_768,
        source=dict(**_SHAPE, rope_theta=10_000.0, max_position_embeddings=16_384,
                    rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)),
        exported=dict(**_SHAPE, head_dim=16, rope_theta=10_000.0, max_position_embeddings=16_384,
                      rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                                        beta_fast=32.0, beta_slow=1.0, truncate=True))),
}
EXPORT_WRITTEN_BEFORE = {"yarn_written_before": dict(EXPORT_CASES["yarn"]["exported"], max_position_embeddings=32_768)}


def make_inputs() -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY["vocab_size"], (2, SEQ_LEN)).astype(np.int32)
    segment_ids = np.ones((2, SEQ_LEN), np.int32)
    positions = np.tile(np.arange(SEQ_LEN, dtype=np.int32), (2, 1))
    start = 0
    for i, n in enumerate(DOCS_ROW1):
        segment_ids[1, start:start + n] = i + 1
        positions[1, start:start + n] = np.arange(n)
        start += n
    assert start == SEQ_LEN
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


def randomise(model, seed: int) -> None:
    """Larger weights than HF's init, random norm gains (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def logits_of(model, inputs) -> np.ndarray:
    """[2, SEQ_LEN, vocab] float32 (a bfloat16 model's logits exactly); row 1 one document at a
    time (positions restart)."""
    out = np.zeros((2, SEQ_LEN, TINY["vocab_size"]), np.float32)
    with torch.no_grad():
        tokens = torch.from_numpy(inputs["tokens"]).long()
        out[0] = model(tokens[:1]).logits[0].float().numpy()
        start = 0
        for n in DOCS_ROW1:
            out[1, start:start + n] = model(tokens[1:, start:start + n]).logits[0].float().numpy()
            start += n
    return out


def rope_golden() -> dict:
    out = {}
    for name, excerpt in ROPE_CASES.items():
        config = LlamaConfig(**json.loads(json.dumps(excerpt)))  # as from_pretrained reads config.json
        rotary = LlamaRotaryEmbedding(config)
        out[name] = {"config": excerpt, "inv_freq": rotary.inv_freq.double().tolist(),
                     "attention_scaling": float(rotary.attention_scaling)}
    return out


def _reading(excerpt: dict) -> dict:
    """What transformers computes from a config.json excerpt (as from_pretrained reads it)."""
    rotary = LlamaRotaryEmbedding(LlamaConfig(**json.loads(json.dumps(excerpt))))
    return {"inv_freq": rotary.inv_freq.double().tolist(), "attention_scaling": float(rotary.attention_scaling)}


def _spelled(excerpt: dict, key: str) -> dict:
    """The excerpt with its rope type under `key` ("type", the older spelling, or "rope_type")."""
    scaling = dict(excerpt["rope_scaling"])
    scaling[key] = scaling.pop("rope_type")
    return {**excerpt, "rope_scaling": scaling}


def rope_export_golden() -> None:
    """Adds this transformers version's readings to rope_export_golden.json (run it with each
    version to compare: 5.x and a 4.4x-4.5x, e.g. 4.51.3, whose YaRN factor comes from
    max_position_embeddings)."""
    path = os.path.join(HERE, "rope_export_golden.json")
    golden = json.load(open(path)) if os.path.exists(path) else {}
    golden["cases"] = EXPORT_CASES
    golden["written_before"] = EXPORT_WRITTEN_BEFORE
    readings = {}
    for name, case in EXPORT_CASES.items():
        readings[name] = {"source_" + key: _reading(_spelled(case["source"], key)) for key in ("type", "rope_type")}
        readings[name]["exported"] = _reading(case["exported"])
    for name, excerpt in EXPORT_WRITTEN_BEFORE.items():
        readings[name] = {"exported": _reading(excerpt)}
    golden.setdefault("transformers", {})[transformers.__version__] = readings
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
    print(f"rope_export_golden.json: readings of transformers {transformers.__version__}")


def bf16_golden() -> None:
    """golden_logits_bf16.npz: transformers' logits of the family models read in bfloat16 (as
    released checkpoints run), from the stored fixtures: the measure of bfloat16's own error,
    against which tests/interop/test_families.py holds longctx's in bfloat16."""
    inputs = dict(np.load(os.path.join(HERE, "inputs.npz")))
    golden = {"positions_index": np.arange(0, SEQ_LEN, LOGIT_STRIDE)}
    for name in BF16_MODELS:
        model = MODELS[name][1].from_pretrained(os.path.join(HERE, name), attn_implementation="eager",
                                                dtype=torch.bfloat16).eval()
        golden[name] = logits_of(model, inputs)[:, ::LOGIT_STRIDE]
        print(f"{name}: bfloat16 logits, max |logit| {np.abs(golden[name]).max():.2f}")
    np.savez(os.path.join(HERE, "golden_logits_bf16.npz"), **golden)


def main() -> None:
    if sys.argv[1:] == ["--rope-export-only"]:
        rope_export_golden()
        return
    if sys.argv[1:] == ["--bf16-only"]:
        bf16_golden()
        return
    torch.manual_seed(0)
    inputs = make_inputs()
    np.savez(os.path.join(HERE, "inputs.npz"), **inputs)
    golden = {"positions_index": np.arange(0, SEQ_LEN, LOGIT_STRIDE)}
    for seed, (name, (config_cls, model_cls, extra)) in enumerate(MODELS.items()):
        config = config_cls(**{**TINY, **extra})
        config._attn_implementation = "eager"  # the plain softmax(QK^T)V reference
        model = model_cls(config).float().eval()
        randomise(model, seed)
        directory = os.path.join(HERE, name)
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory, safe_serialization=True)
        for extra_file in ("generation_config.json",):
            path = os.path.join(directory, extra_file)
            if os.path.exists(path):
                os.remove(path)
        reloaded = model_cls.from_pretrained(directory, attn_implementation="eager").float().eval()
        logits = logits_of(reloaded, inputs)
        np.testing.assert_array_equal(logits, logits_of(model, inputs))
        golden[name] = logits[:, ::LOGIT_STRIDE]
        print(f"{name}: logits std {logits.std():.3f}, max |logit| {np.abs(logits).max():.2f}")
    np.savez(os.path.join(HERE, "golden_logits.npz"), **golden)
    with open(os.path.join(HERE, "rope_golden.json"), "w") as f:
        json.dump(rope_golden(), f, indent=1)
    rope_export_golden()
    bf16_golden()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                "numpy": np.__version__}
    with open(os.path.join(HERE, "versions.json"), "w") as f:
        json.dump(versions, f, indent=1)
    print(versions)


if __name__ == "__main__":
    main()
