"""The grid steps splash walks with nothing live (each strategy's dead_grid_steps): one grid
for every device, q blocks x the busiest row's live kv blocks (forward, dQ) and kv blocks x the
busiest column's live q blocks (dK/dV), against a brute force over the exact classifier."""
import numpy as np
import pytest

from longctx.ops import context_parallel, masks, tables
from longctx.plan import attention_work


def _brute_ring(spec, layout, seq_len, sp, block):
    live = tables.block_classes(spec, layout, seq_len, sp, block, block) > 0  # [a, s, q, kv]
    nq = live.shape[2]
    rows = cols = 0
    for s in range(sp):
        critical = live[:, s].sum(axis=(1, 2)).max()
        if critical:
            rows += nq * live[:, s].sum(axis=2).max() - critical
            cols += nq * live[:, s].sum(axis=1).max() - critical
    return rows, cols


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, sliding_window=300)])
def test_the_rings_dead_grid_steps_are_a_brute_force_count(layout, mask):
    spec = masks.make_mask_spec(**mask)
    live = attention_work.static_live_blocks(spec, layout, 4096, 4, 128)
    want = _brute_ring(spec, layout, 4096, 4, 128)
    assert context_parallel.named("ring").dead_grid_steps(live) == want


@pytest.mark.parametrize("strategy,degree", [("all_gather", None), ("ring", None), ("usp", 2),
                                             ("usp", 4), ("ulysses", None)])
def test_a_balanced_layout_halves_the_live_blocks_not_the_grid(strategy, degree):
    """Causal, 64 blocks a device: contiguous and zigzag walk the same grid on the critical path
    (q blocks x every kv block), but zigzag's device has half of it live."""
    spec = masks.make_mask_spec(causal=True)
    sp, nq = 8, 8
    walked = {}
    for layout in ("contiguous", "zigzag"):
        s = attention_work.static_schedule(context_parallel.named(strategy, degree), spec, layout,
                                           sp * nq * 128, sp, 128)
        assert s.dead_rows == s.dead_columns >= 0
        walked[layout] = s.critical_path + s.dead_rows
        if layout == "zigzag":
            assert s.dead_rows == pytest.approx(s.critical_path, rel=0.05)
    assert walked["contiguous"] == walked["zigzag"] == nq * nq * sp


def test_a_full_mask_walks_no_dead_step():
    spec = masks.make_mask_spec(causal=False)
    for strategy, degree in [("all_gather", None), ("ring", None), ("usp", 4)]:
        chosen = context_parallel.named(strategy, degree)
        s = attention_work.static_schedule(chosen, spec, "zigzag", 8192, 8, 128)
        assert (s.dead_rows, s.dead_columns) == (0.0, 0.0)
