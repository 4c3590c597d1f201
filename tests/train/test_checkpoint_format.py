"""A checkpoint written by an older longctx (before its packages took their present layout) restores
exactly.

tests/fixtures/checkpoint_2373a90 was written by main at 2373a90 (its made_by.json holds the
command): a 2-step run of a small tiny-model variant. Its parameters must read back as that
commit read them (params_digest.json), and resuming it for one more step must give the loss,
gradient norm and learning rate that commit gave on the same resume (made_by.json). The on-disk
layout (checkpoints/<step>/{state,data,config,metadata}) and the names of the saved state are
what must not move with the code.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import base
from longctx.evals import inference
from longctx.train import loop as train
from tests import FIXTURES

FIXTURE = os.path.join(FIXTURES, "checkpoint_2373a90")


def _config(num_steps: int):
    """The fixture's config (made_by.json's command), as the code builds it today."""
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.update(seq_len=256, global_batch_size=2)
    c.attention.block_size = 32
    c.train.update(num_steps=num_steps, eval_every=0, loss_chunk_size=64)
    c.checkpoint.every_steps = 0
    return c


@pytest.fixture
def workdir(tmp_path):
    """A copy: a test must never write into the fixture."""
    return shutil.copytree(FIXTURE, str(tmp_path / "run"))


def test_parameters_read_back_as_the_writing_commit_read_them(workdir):
    expected = json.load(open(os.path.join(FIXTURE, "params_digest.json")))
    runner = inference.runner_from_checkpoint(workdir)
    leaves = jax.tree_util.tree_flatten_with_path(runner.params)[0]
    read = {}
    for path, value in leaves:
        a = np.asarray(jax.device_get(value), dtype=np.float64)
        read[jax.tree_util.keystr(path)] = {"shape": list(a.shape), "sum": float(a.sum()),
                                            "abs_sum": float(np.abs(a).sum())}
    assert sorted(read) == sorted(expected)
    for name, digest in expected.items():
        assert read[name]["shape"] == digest["shape"], name
        # The same float32 values summed the same way: equal up to summation order.
        np.testing.assert_allclose(read[name]["sum"], digest["sum"], rtol=1e-9, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(read[name]["abs_sum"], digest["abs_sum"], rtol=1e-9, err_msg=name)


def test_resuming_continues_as_the_writing_commit_did(workdir, capsys):
    made_by = json.load(open(os.path.join(FIXTURE, "made_by.json")))["resumed_step_3"]
    train.train_and_evaluate(_config(num_steps=3), workdir)
    out = capsys.readouterr().out
    assert f"resumed from {workdir}/checkpoints/2 (step 2), data iterator included" in out, out
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Same code path, same inputs: equal but for XLA:CPU's choice of vector width on another CPU.
    for key in ("train/loss", "train/grad_norm", "train/learning_rate"):
        np.testing.assert_allclose(rows[-1][key], made_by[key], rtol=1e-5, err_msg=key)
