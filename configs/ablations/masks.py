"""Mask-type ablation: the same tiny model and data, one attention mask per variant.

  .venv/bin/python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks
  .venv/bin/python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks --dry-run

`get_grid()` maps a variant name to config overrides applied on top of `BASE`; everything not
overridden is equal across variants. The tiny preset's sequences of 1,024 tokens over sp=4 give
each device a shard of 256 tokens, so the window of 128 reaches half a shard back and the window
and chunks of 512 span two shards.
"""

BASE = "configs/base.py:tiny"

# Shared by every variant (a short run; raise num_steps for a real comparison).
COMMON = {
    "train.num_steps": 120,
    "train.eval_every": 60,
    "train.eval_steps": 4,
    "checkpoint.every_steps": 60,
}


def get_grid() -> dict[str, dict]:
    return {
        "causal": {},
        "sliding_window_128": {"attention.sliding_window": 128},
        "sliding_window_512": {"attention.sliding_window": 512},
        "chunked_causal_512": {"attention.chunk_size": 512},
        "causal_sinks": {"attention.attention_sinks": True},
        "causal_soft_cap_30": {"attention.logits_soft_cap": 30.0},
        "no_document_mask": {"attention.use_segment_ids": False},
    }
