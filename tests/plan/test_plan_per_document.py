"""The planner prices the per-document layout on the run's documents: a candidate where it has
rows to lay out, priced by the ring's schedule of those rows laid out (as a run's pipeline lays
them out), and the fastest layout on documents whose work the static layouts cannot balance."""

import numpy as np
import pytest

from longctx.model import attention as attention_lib
from longctx.ops import masks, strategy_schedule
from longctx.plan import planner, step_time
from tests.plan.test_plan_documents import SEQ, TOPOLOGY, _config


def _rows() -> np.ndarray:
    """Rows of a long document (half the row) among short ones."""
    rows = np.zeros((2, SEQ), np.int32)
    for r in range(2):
        lengths = [SEQ // 2] + [300 + 100 * r] * (SEQ // (600 + 200 * r))
        ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:SEQ]
        rows[r, :len(ids)] = np.roll(ids, 1000 * r)
    return rows


def test_per_document_is_priced_on_the_documents():
    c = _config(1)
    ids = _rows()
    rows = planner.plan(c, TOPOLOGY, open_keys=("attention.layout",), segment_ids=ids)
    by_layout = {r.layout: r for r in rows}
    assert set(by_layout) == {"contiguous", "zigzag", "striped", "per_document"}
    assert "per_document" not in {r.layout for r in planner.plan(c, TOPOLOGY, open_keys=("attention.layout",))}
    spec = masks.make_mask_spec(**attention_lib.mask_kwargs(c.attention))
    ring = by_layout["per_document"].strategy.cp
    mesh = {"dp": 1, "fsdp": 1, "sp": 8}
    want = np.mean([step_time.estimate(by_layout["per_document"].config, TOPOLOGY,
                                       strategy_schedule.strategy_schedule(
                                           ring, spec, "per_document", SEQ, 8, 512, ids[i:i + 1],
                                           count_kept=False),
                                       mesh, rows_in_schedule=1).attention for i in range(2)])
    assert by_layout["per_document"].step.attention == pytest.approx(want, rel=1e-9)
    assert by_layout["per_document"].step.attention < min(
        by_layout[layout].step.attention for layout in ("contiguous", "zigzag", "striped"))
