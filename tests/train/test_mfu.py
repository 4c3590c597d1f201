"""MFU of the work the mask needs, as a run logs it: each logged step's attention pairs are those
of the batches it trained on (their documents' pairs, counted on the host), and metrics.jsonl and
the log line say what is counted."""

import json
import os

import jax
import numpy as np
import pytest

from configs import base
from longctx import data as data_lib
from longctx.data import prepare
from longctx.model import flops
from longctx.parallel import mesh as mesh_lib
from longctx.train import loop as train_loop
from longctx.train import state as train_state
from tests.synthetic import make_corpus


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """Documents of 9-320 tokens: a 512-token row packs several."""
    root = tmp_path_factory.mktemp("short_documents")
    prepare.prepare([str(make_corpus(root, num_docs=400))], str(root / "data"), val_fraction=0.1,
                    progress=False)
    return str(root / "data")


def _config(data_dir, **attention):
    c = base.get_config("tiny")
    c.unlock()
    c.data.path = data_dir
    c.model.update(d_model=64, mlp_dim=128, head_dim=16)
    c.data.update(seq_len=512, global_batch_size=2)
    c.attention.update(block_size=128, **attention)
    c.train.update(num_steps=3, log_every=1, eval_every=0, loss_chunk_size=128, peak_tflops_override=1.0)
    c.checkpoint.update(every_steps=0)
    return c


def _rows(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _batches_pairs(config, steps: int) -> list[int]:
    """The attention pairs of the run's first `steps` batches, from a second iterator of its data."""
    mesh = mesh_lib.make_mesh(config.mesh)
    layout = train_state.resolve_layout(config, mesh.shape[mesh_lib.SP],
                                        data_lib.layout_sample(config, data_lib.resolve_dataset(config)))
    iterator = data_lib.make_batch_iterator(config, mesh, split="train", layout=layout,
                                            data_dir=data_lib.resolve_dataset(config))
    try:
        return [flops.attention_pairs(config, iterator.next_local()["segment_ids"]) for _ in range(steps)]
    finally:
        iterator.close()


def test_a_packed_run_counts_the_pairs_of_its_documents(tmp_path, capsys, short_documents):
    """Rows pack several documents: the steps count their own documents' causal
    pairs, a fraction of the rows', and MFU is model FLOPs over those pairs (it counted the whole
    rows' causal attention, so a packed run read higher MFU than one causal row while doing less)."""
    config = _config(short_documents)
    workdir = str(tmp_path / "run")
    train_loop.train_and_evaluate(config, workdir)
    rows = _rows(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    want = _batches_pairs(config, 3)
    for row, pairs in zip(rows[1:], want[1:]):  # (the first step is untimed: no MFU)
        assert row["train/attention_pairs"] == pairs < flops.attention_pairs(config) / 2
        assert row["train/attention_pairs_share"] == pairs / flops.attention_pairs(config)
        assert row["train/mfu_attention_counts"] == "causal pairs within documents"
        counted = flops.flops_per_step(config, pairs) / row["train/step_time_s"] / 1e12 / jax.device_count()
        assert np.isclose(row["train/mfu"], counted, rtol=1e-12)
    out = capsys.readouterr().out
    share = rows[2]["train/attention_pairs_share"]
    assert f"(attention: causal pairs within documents, {share:.1%} of whole rows' pairs)" in out, out


def test_without_segment_ids_each_row_is_one_document(tmp_path, capsys, short_documents):
    config = _config(short_documents, use_segment_ids=False)
    workdir = str(tmp_path / "run")
    train_loop.train_and_evaluate(config, workdir)
    for row in _rows(workdir)[1:]:
        assert row["train/attention_pairs"] == flops.attention_pairs(config) == 2 * 2 * 512 * 513 // 2
        assert row["train/mfu_attention_counts"] == "causal pairs of whole rows"
    assert "(attention: causal pairs of whole rows)" in capsys.readouterr().out
