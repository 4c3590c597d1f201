"""The attention blocks each device computes under a context-parallel strategy, fast enough to
price every candidate of a plan (2,097,152 tokens over 64 devices in a second).

With packed documents the work comes from the documents themselves: `ops.strategy_schedule` on
sampled rows (exact, as the ring's own tables; seconds at 131,072 tokens). Without documents (or
with one per row) the static mask decides: a block pair is live when the union of its queries'
allowed key intervals meets one of its key runs. Each query's interval [lo, hi] holds the query
and has both ends non-decreasing in its position (masks.MaskSpec.bounds), so over a run of
consecutive positions the union is the single interval [lo(first), hi(last)]: the test is exact
wherever blocks are runs of consecutive positions (contiguous, zigzag, striped with stripes of
several tokens). Token stripes (stride sp) fall back to ops/tables.block_classes, which decides
the same from the same run ends and also tells full blocks from partial ones: about 10x this
one's time for the live test alone (0.44 against 0.04 s at 2,097,152 tokens over 64 devices,
block 512), paid per candidate of a plan. tests/plan/test_planner.py checks the two agree.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from longctx.ops import masks, strategy_schedule, tables
from longctx.parallel import layout as layout_lib


@functools.lru_cache(maxsize=256)
def static_live_blocks(spec: masks.MaskSpec, layout: str, seq_len: int, sp: int,
                       block: int) -> np.ndarray:
    """bool [device a, ring step s, q block, kv block]: the live blocks of the pair
    (a, (a - s) mod sp) under the static mask (read-only; cached)."""
    first, length, stride = tables.block_runs(layout, seq_len, sp, block)
    if stride != 1:  # token stripes: blocks are not runs of consecutive positions
        out = tables.block_classes(spec, layout, seq_len, sp, block, block) > 0
        out.setflags(write=False)
        return out
    pos = layout_lib.shard_positions(layout, seq_len, sp).astype(np.int64)
    starts = pos[:, first]                       # [shard, block, run] first position of each run
    ends = starts + length[None] - 1
    valid = np.broadcast_to(length[None] > 0, starts.shape)
    lo, _ = spec.bounds(starts)                  # the union of a query run's key intervals
    _, hi = spec.bounds(ends)
    nq = first.shape[0]
    out = np.zeros((sp, sp, nq, nq), bool)
    for s in range(sp):
        kv = (np.arange(sp) - s) % sp            # the K/V shard device a holds at step s
        k_start, k_end, k_valid = starts[kv], ends[kv], valid[kv]
        # [a, q block, q run, kv block, kv run]
        meets = ((k_start[:, None, None] <= hi[:, :, :, None, None])
                 & (k_end[:, None, None] >= lo[:, :, :, None, None])
                 & valid[:, :, :, None, None] & k_valid[:, None, None])
        out[:, s] = meets.any(axis=(2, 4))
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=256)
def static_step_blocks(spec: masks.MaskSpec, layout: str, seq_len: int, sp: int,
                       block: int) -> np.ndarray:
    """int [device a, ring step s]: live blocks of the pair (a, (a - s) mod sp) under the static
    mask (read-only; cached)."""
    out = static_live_blocks(spec, layout, seq_len, sp, block).sum(axis=(2, 3))
    out.setflags(write=False)
    return out


def static_schedule(strategy, spec: masks.MaskSpec, layout: str, seq_len: int, sp: int,
                    block: int) -> strategy_schedule.StrategySchedule:
    """`strategy`'s schedule (an ops.strategy.Strategy) on rows of one document each (or no
    segment ids): the static mask's blocks, the ring running every step that holds one (it cannot
    stop early without documents)."""
    if spec.chunk is not None or layout_lib.per_row(layout):
        # With segment ids a chunked mask runs as the causal window a chunk spans and prunes by
        # chunk ids (ring.prepare): the per-document path prices that exactly. A per-row layout
        # has no static blocks: a row of one document is laid out and priced as any row. The
        # element-wise count of kept blocks (minutes at 128K tokens) is left out: a plan reads
        # the work only.
        ids = np.ones((1, seq_len), np.int32)
        return strategy_schedule.strategy_schedule(strategy, spec, layout, seq_len, sp, block, ids,
                                                   count_kept=False)
    per_step = static_step_blocks(spec, layout, seq_len, sp, block)
    run = [s for s in range(sp) if per_step[:, s].any()]
    critical = float(sum(per_step[:, s].max() for s in run))
    schedule = strategy.from_step_blocks(per_step, critical, int(per_step.sum()), len(run),
                                         strategy_schedule.by_pair(per_step) > 0)
    live = static_live_blocks(spec, layout, seq_len, sp, block)
    dead_rows, dead_columns = strategy.dead_grid_steps(live)
    return GridSchedule(**{f.name: getattr(schedule, f.name)
                           for f in dataclasses.fields(strategy_schedule.StrategySchedule)},
                        dead_rows=dead_rows, dead_columns=dead_columns)


@dataclasses.dataclass(frozen=True)
class GridSchedule(strategy_schedule.StrategySchedule):
    """A static schedule with the grid steps its kernels walk and compute nothing in, on the
    critical path, in blocks of all heads as `critical_path` counts (the strategy's
    `dead_grid_steps`): `dead_rows` for the kernels whose grid runs over q blocks x the busiest
    row's kv blocks (forward, dQ), `dead_columns` for the one over kv blocks x the busiest
    column's q blocks (dK/dV).

    Splash sizes a call's grid once for every device (one SPMD program; with q_seq_shards it
    pads each shard's tables to the widest shard's, splash_attention_mask_info._process_mask):
    q blocks x the most live kv blocks any q row of any device has in that call (forward, dQ),
    kv blocks x the most live q blocks of any column (dK/dV). A step with no live block fetches
    nothing (its table repeats the last block) and computes nothing, but is still a grid step.
    Under a causal mask the busiest row of a call sees every block of it: a load-balanced
    layout halves a device's live blocks, not its grid (the all-gather's device walks its q
    blocks x the whole sequence either way), which is why it gains less than its work says."""
    dead_rows: float = 0.0
    dead_columns: float = 0.0
