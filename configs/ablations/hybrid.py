"""Hybrid-attention ablation: the same tiny model and data, one pattern of layer types per variant.

  .venv/bin/python scripts/ablate.py --grid=configs/ablations/hybrid.py --workdir=runs/ablate_hybrid --seeds=3
  .venv/bin/python scripts/ablate.py --grid=configs/ablations/hybrid.py --workdir=runs/ablate_hybrid --dry-run

`get_grid()` maps a variant name to config overrides applied on top of `BASE`; everything not
overridden is equal across variants. A variant sets `attention.pattern` (the layer types of one
period, docs/attention.md "Hybrid attention") and `attention.layer_types` as a whole dict (a dict
for a ConfigDict-valued key replaces it: on the command line it is the dict's Python literal).

Every variant has 12 layers, the least common multiple of the periods 2, 4 and 6, so each pattern
repeats whole (1:1 is 6 local + 6 global, 3:1 is 9 + 3, 5:1 is 10 + 2). The tiny preset's
sequences of 1,024 tokens over sp=4 give each device a shard of 256 tokens; the windows are scaled
to that sequence: the gpt-oss-like short window of 32 is 1/32 of it (gpt-oss: 128), the Cohere- and
Gemma-3-like window of 128 is half a shard (Command R7B: 4,096; Gemma 3: 1,024), and the Llama-4-like
chunk of 256 is one shard (Llama 4: 8,192), with the temperature floor at the chunk as Llama 4's.
The local layers pass only their halo between devices (`cp="halo"`, as tiny_hybrid's); the global
layers run the ring.
"""

BASE = "configs/base.py:tiny"

# Shared by every variant: 12 layers (above), a short run (5 variants x 3 seeds took 67 minutes on
# 2 CPU cores shared with other work: docs/ablation_hybrid.md); raise num_steps for a real comparison.
COMMON = {
    "model.num_layers": 12,
    "train.num_steps": 50,
    "train.log_every": 5,
    "train.eval_every": 50,
    "train.eval_steps": 4,
    "checkpoint.every_steps": 25,
}

SHORT_WINDOW = 32  # gpt-oss-like
WINDOW = 128  # Cohere-like, Gemma-3-like
CHUNK = 256  # Llama-4-like


def get_grid() -> dict[str, dict]:
    return {
        "global_only": {},
        # gpt-oss: sliding and full layers alternating, learned sinks on both.
        "gpt_oss_1to1_window32_sinks": {
            "attention.pattern": "local,global",
            "attention.layer_types": {"local": {"sliding_window": SHORT_WINDOW, "attention_sinks": True,
                                                "cp": "halo"},
                                      "global": {"attention_sinks": True}},
        },
        # Cohere Command R7B / A: three sliding layers (RoPE) to one full layer without RoPE.
        "cohere_3to1_window128_nope": {
            "attention.pattern": "local,local,local,global",
            "attention.layer_types": {"local": {"sliding_window": WINDOW, "cp": "halo"}, "global": {"rope": False}},
        },
        # Gemma 3: five sliding layers (RoPE theta 10,000) to one global (theta 1,000,000).
        "gemma3_5to1_window128": {
            "attention.pattern": "local,local,local,local,local,global",
            "attention.layer_types": {"local": {"sliding_window": WINDOW, "rope_theta": 10_000.0, "cp": "halo"},
                                      "global": {"rope_theta": 1_000_000.0}},
        },
        # Llama 4: three chunked layers (RoPE) to one full layer without RoPE whose queries are
        # scaled by position ("temperature tuning", floor 8,192 and scale 0.1 in Llama 4).
        "llama4_3to1_chunk256_nope": {
            "attention.pattern": "local,local,local,global",
            "attention.layer_types": {"local": {"chunk_size": CHUNK, "cp": "halo"},
                                      "global": {"rope": False, "temperature_floor": CHUNK,
                                                 "temperature_scale": 0.1}},
        },
    }
