"""Documents priced per batch of the rows one sp group holds: a run with one row
per sp group waits, at each ring step, for the busiest device on that row alone, and its ring
stops where that row's documents stop; the planner prices each sampled batch so and averages."""

import copy

import numpy as np
import pytest

from configs import base
from longctx.model import attention as attention_lib
from longctx.ops import masks, strategy_schedule
from longctx.plan import hardware, planner, step_time

TOPOLOGY = hardware.parse_topology("v5p:2x2x2")
SEQ = 8192


def _config(batch: int):
    c = copy.deepcopy(base.get_config("tiny"))
    c.unlock()
    c.model.update(dtype="bfloat16", num_layers=4)
    c.attention.update(impl="splash", block_size=512, layout="contiguous", use_segment_ids=True)
    c.data.update(seq_len=SEQ, global_batch_size=batch)
    c.mesh.update(dp=1, fsdp=1, sp=8)
    c.lock()
    return c


def _rows() -> np.ndarray:
    """Four rows whose documents differ (in the contiguous layout each row's busiest device and
    last ring step differ): one document; one in the first half and padding after it; padding
    then one document in the second half; short documents."""
    rows = np.zeros((4, SEQ), np.int32)
    rows[0] = 1
    rows[1, :SEQ // 2] = 1
    rows[2, SEQ // 2:] = 1
    rows[3] = np.arange(SEQ) // 512 + 1
    return rows


@pytest.mark.parametrize("batch", [1, 2])
def test_each_batch_of_an_sp_group_s_rows_is_priced_on_its_own(batch):
    """Brute force: each batch of `batch` sampled rows (the rows one sp group holds) scheduled
    alone, its step priced, the attention and the context-parallel traffic averaged over the
    batches. Scheduling the four rows as one batch and dividing by four takes the busiest device
    of the sum, not of each batch, and the ring steps of the rows' union."""
    c = _config(batch)
    ids = _rows()
    rows = planner.plan(c, TOPOLOGY, open_keys=("attention.cp",), segment_ids=ids)
    spec = masks.make_mask_spec(**attention_lib.mask_kwargs(c.attention))
    mesh = {"dp": 1, "fsdp": 1, "sp": 8}
    checked = set()
    for row in rows:
        s = row.strategy
        if s.name in checked:
            continue
        checked.add(s.name)
        per_batch = []
        for i in range(0, len(ids), batch):
            schedule = strategy_schedule.strategy_schedule(s.cp, spec, "contiguous", SEQ, 8, 512,
                                                           ids[i:i + batch], count_kept=False)
            per_batch.append(step_time.estimate(row.config, TOPOLOGY, schedule, mesh,
                                                rows_in_schedule=batch))
        want_attention = np.mean([e.attention for e in per_batch])
        assert row.step.attention == pytest.approx(want_attention, rel=1e-9), s
        for kind in per_batch[0].communication:
            if kind.startswith("cp_"):
                want = np.mean([e.communication[kind] for e in per_batch])
                assert row.step.communication[kind] == pytest.approx(want, rel=1e-9), (s, kind)
    assert {"ring", "all_gather"} <= checked
