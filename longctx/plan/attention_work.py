"""The attention blocks each device computes under a context-parallel strategy, fast enough to
price every candidate of a plan (2,097,152 tokens over 64 devices in a second).

With packed documents the work comes from the documents themselves: `ops.strategy_schedule` on
sampled rows (exact, as the ring's own tables; seconds at 131,072 tokens). Without documents (or
with one per row) the static mask decides, and ops/tables.py's exact classifier, which looks at
every query of every block (2,097,152 tokens over 64 devices: 4 minutes), is more than a plan
needs: here a block pair is live when the union of its queries' allowed key intervals meets one of
its key runs. Each query's interval [lo, hi] has both ends non-decreasing in its position
(masks.MaskSpec.bounds), so over a run of consecutive positions the union is the single interval
[lo(first), hi(last)]: the test is exact wherever blocks are runs of consecutive positions
(contiguous, zigzag, striped with stripes of several tokens). Token stripes (stride sp) fall back
to the exact classifier. tests/plan/test_planner.py checks the two agree.
"""

from __future__ import annotations

import functools

import numpy as np

from longctx.ops import masks, strategy_schedule, tables
from longctx.parallel import layout as layout_lib


@functools.lru_cache(maxsize=256)
def static_step_blocks(spec: masks.MaskSpec, layout: str, seq_len: int, sp: int,
                       block: int) -> np.ndarray:
    """int [device a, ring step s]: live blocks of the pair (a, (a - s) mod sp) under the static
    mask (read-only; cached)."""
    first, length, stride = tables.block_runs(layout, seq_len, sp, block)
    if stride != 1:  # token stripes: blocks are not runs of consecutive positions
        out = (tables.block_classes(spec, layout, seq_len, sp, block, block) > 0).sum(axis=(2, 3))
        out.setflags(write=False)
        return out
    pos = layout_lib.shard_positions(layout, seq_len, sp).astype(np.int64)
    starts = pos[:, first]                       # [shard, block, run] first position of each run
    ends = starts + length[None] - 1
    valid = np.broadcast_to(length[None] > 0, starts.shape)
    lo, _ = spec.bounds(starts)                  # the union of a query run's key intervals
    _, hi = spec.bounds(ends)
    out = np.zeros((sp, sp), np.int64)
    for s in range(sp):
        kv = (np.arange(sp) - s) % sp            # the K/V shard device a holds at step s
        k_start, k_end, k_valid = starts[kv], ends[kv], valid[kv]
        # [a, q block, q run, kv block, kv run]
        meets = ((k_start[:, None, None] <= hi[:, :, :, None, None])
                 & (k_end[:, None, None] >= lo[:, :, :, None, None])
                 & valid[:, :, :, None, None] & k_valid[:, None, None])
        out[:, s] = meets.any(axis=(2, 4)).sum(axis=(1, 2))
    out.setflags(write=False)
    return out


def static_schedule(strategy: str, degree: int | None, spec: masks.MaskSpec, layout: str,
                    seq_len: int, sp: int, block: int) -> strategy_schedule.StrategySchedule:
    """`strategy`'s schedule on rows of one document each (or no segment ids): the static mask's
    blocks, the ring running every step that holds one (it cannot stop early without documents)."""
    if spec.chunk is not None:
        # With segment ids a chunked mask runs as the causal window a chunk spans and prunes by
        # chunk ids (ring.prepare): the per-document path prices that exactly. Its element-wise
        # count of kept blocks (minutes at 128K tokens) is left out: a plan reads the work only.
        ids = np.ones((1, seq_len), np.int32)
        return strategy_schedule.strategy_schedule(strategy, degree, spec, layout, seq_len, sp,
                                                   block, ids, count_kept=False)
    per_step = static_step_blocks(spec, layout, seq_len, sp, block)
    run = [s for s in range(sp) if per_step[:, s].any()]
    critical = float(sum(per_step[:, s].max() for s in run))
    return strategy_schedule.from_step_blocks(strategy, degree, per_step, critical,
                                              int(per_step.sum()), len(run),
                                              strategy_schedule.by_pair(per_step) > 0)
