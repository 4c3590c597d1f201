"""A three-variant grid small enough for the test suite (tests/evals/test_ablate.py).

  .venv/bin/python scripts/ablate.py --grid=configs/ablations/smoke.py --workdir=runs/ablate_smoke
"""

BASE = "configs/base.py:tiny"

COMMON = {
    "model.num_layers": 1,
    "data.seq_len": 512,
    "attention.block_size": 128,
    "train.loss_chunk_size": 128,
    "train.num_steps": 4,
    "train.log_every": 2,
    "train.eval_every": 4,
    "train.eval_steps": 1,
    "checkpoint.every_steps": 2,
}


def get_grid() -> dict[str, dict]:
    return {
        "causal": {},
        "sliding_window_64": {"attention.sliding_window": 64},
        "no_document_mask": {"attention.use_segment_ids": False},
    }
