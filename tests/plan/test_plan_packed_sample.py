"""A --data sample priced as each candidate's run packs it: data.packer =
shard_balanced places documents into the sp shards of a row, counting work in blocks of the
ring's block, so the rows a candidate trains on depend on its sp and block. The planner prices
each candidate on the sample packed with that candidate's sp and block, packed once per distinct
setting (pipeline.PackedSample); a packer that ignores them (best_fit) packs once for all."""

import copy
import json
import random

import numpy as np
import pytest

from configs import base
from longctx.data import pipeline, prepare
from longctx.model import attention as attention_lib
from longctx.ops import masks, strategy_schedule
from longctx.plan import hardware, planner, step_time

TOPOLOGY = hardware.parse_topology("v5p:2x2x2")
SEQ = 8192


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    """60 documents of 100-3,000 bytes (byte tokenizer): whole shards at sp=8 (1,024 tokens) hold
    a few of them, and the longer ones span shards."""
    root = tmp_path_factory.mktemp("packed_sample")
    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(
        rng.randint(100, 3000)))}) + "\n" for _ in range(60)))
    prepare.prepare([str(corpus)], str(root / "data"), val_fraction=0.1, progress=False)
    return str(root / "data")


def _config(packer: str, data_dir: str):
    c = copy.deepcopy(base.get_config("tiny"))
    c.unlock()
    c.model.update(dtype="bfloat16", num_layers=4)
    c.attention.update(impl="splash", block_size=512, layout="contiguous", use_segment_ids=True)
    c.data.update(seq_len=SEQ, global_batch_size=2, packer=packer, path=data_dir)
    c.mesh.update(dp=1, fsdp=1, sp=8)
    c.lock()
    return c


def _first_rows(c, sp: int, block: int) -> np.ndarray:
    """Brute force: the first 8 rows a run of this sp and block packs (its packer, its shuffle
    seed, data shard 0 of 1), straight from the packer."""
    it = iter(pipeline.packed_rows(c.data.path, "train", seq_len=SEQ, packer=c.data.packer,
                                   seed=c.data.shuffle_seed, num_shards=sp, block_size=block))
    try:
        return np.stack([next(it)["segment_ids"] for _ in range(8)])
    finally:
        it.close()


def _brute_force(row, ids: np.ndarray) -> list[step_time.StepEstimate]:
    """The row's step on `ids`: each batch of the rows one sp group holds scheduled alone, its
    step priced with those rows' document pairs, the batches averaged."""
    c, sp, s = row.config, row.mesh["sp"], row.strategy
    spec = masks.make_mask_spec(**attention_lib.mask_kwargs(c.attention))
    batch = planner.batch_rows(c, row.mesh, ids)
    per_batch = []
    for i in range(0, len(ids), batch):
        schedule = strategy_schedule.strategy_schedule(s.cp, spec, row.layout, SEQ, sp,
                                                       row.block, ids[i:i + batch], count_kept=False)
        per_batch.append(step_time.estimate(c, TOPOLOGY, schedule, row.mesh, rows_in_schedule=batch,
                                            pairs_per_row=step_time.document_pairs(c, ids)))
    return per_batch


def test_shard_balanced_prices_each_candidate_on_its_own_packing(data_dir):
    c = _config("shard_balanced", data_dir)
    assert not np.array_equal(_first_rows(c, 4, 512), _first_rows(c, 8, 512))  # the packing differs
    sample = pipeline.PackedSample(c, data_dir)
    rows = planner.plan(c, TOPOLOGY, open_keys=("mesh", "attention.cp"), segment_ids=sample)
    assert sample.packings == len({r.mesh["sp"] for r in rows}) == 2  # once per sp (one block)
    checked = set()
    for row in rows:
        key = (row.mesh["sp"], row.strategy.name)
        if row.mesh["sp"] == 1 or row.strategy.degree is not None or key in checked:
            continue
        checked.add(key)
        per_batch = _brute_force(row, _first_rows(c, row.mesh["sp"], row.block))
        assert row.step.attention == pytest.approx(np.mean([e.attention for e in per_batch]), rel=1e-9), key
        for kind in per_batch[0].communication:
            if kind.startswith("cp_"):
                want = np.mean([e.communication[kind] for e in per_batch])
                assert row.step.communication[kind] == pytest.approx(want, rel=1e-9), (key, kind)
        assert row.step.model_flops == pytest.approx(per_batch[0].model_flops, rel=1e-9), key  # MFU's
    # (global batch 2: sp=4 holds one row per sp group, sp=8 two)
    assert {(sp, s) for sp in (4, 8) for s in ("ring", "all_gather")} <= checked


def test_a_packer_that_ignores_sp_and_block_packs_once_and_prices_as_before(data_dir):
    """best_fit fills rows without regard to shards: one packing serves every candidate, and the
    plan is the one priced on layout_sample's rows."""
    c = _config("best_fit", data_dir)
    sample = pipeline.PackedSample(c, data_dir)
    rows = planner.plan(c, TOPOLOGY, open_keys=("mesh", "attention.cp"), segment_ids=sample)
    assert sample.packings == 1
    before = planner.plan(c, TOPOLOGY, open_keys=("mesh", "attention.cp"),
                          segment_ids=pipeline.layout_sample(c, data_dir))
    assert [r.step.as_dict() for r in rows] == [r.step.as_dict() for r in before]
