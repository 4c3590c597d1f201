"""A run in the per-document layout, stopped and resumed, is the same run: each row's layout is a
function of the row alone, so the resumed data iterator lays out the same rows, and every
step's loss and gradient norm after the resume are the uninterrupted run's, bitwise."""

import json
import os

from configs import base
from longctx.train import loop as train


def _config(num_steps: int):
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.update(seq_len=512, global_batch_size=2)
    c.attention.update(block_size=64, layout="per_document")
    c.train.update(num_steps=num_steps, eval_every=0, log_every=1, loss_chunk_size=128)
    c.checkpoint.every_steps = 2
    # a constant learning rate: the schedule does not depend on where the run was told to end
    c.optimizer.update(warmup_steps=0, min_learning_rate_ratio=1.0)
    return c


def _logged(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: (r["train/loss"], r.get("train/grad_norm")) for r in rows}


def test_a_resumed_run_is_the_same_run(tmp_path, capsys):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    train.train_and_evaluate(_config(3), whole)
    train.train_and_evaluate(_config(2), parts)
    train.train_and_evaluate(_config(3), parts)
    out = capsys.readouterr().out
    assert f"resumed from {parts}/checkpoints/2 (step 2), data iterator included" in out, out
    assert "layout per_document" in out, out
    uninterrupted, resumed = _logged(whole), _logged(parts)
    assert sorted(uninterrupted) == [1, 2, 3]
    assert resumed[3] == uninterrupted[3]
