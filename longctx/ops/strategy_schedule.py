"""What each context-parallel strategy computes for given rows of documents (host, for reports and
the planner): the work of every device, the critical path, the ring steps K/V travel.

Every strategy computes the same (query shard, K/V shard) pairs, with the same live blocks
(ops/shard_pairs.py); `tables.document_schedule` counts them per (device, ring step), where ring
step s on device a is the pair (a, (a - s) mod sp). The strategies differ in who computes each
pair and what waits for what: each says so in its `from_step_blocks` (ops/strategy.py), which
turns those counts into its own steps.

Work is counted in blocks of all heads (a Ulysses device's pair for n/U heads counts 1/U), so
that every strategy's total is the same: the live blocks, which for packed rows are exactly the
kept blocks (the blocks holding a pair the mask and the documents allow).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from longctx.ops import masks, shard_pairs
from longctx.ops import tables as tables_lib


@dataclasses.dataclass(frozen=True)
class StrategySchedule:
    strategy: str
    degree: int
    # float [device, step]: blocks (of all heads) each device computes at each step of the
    # strategy: the ring's steps (ring), the ring of groups' (usp), one (all_gather, ulysses)
    step_work: np.ndarray
    critical_path: float          # blocks on the slowest path, with the strategy's waits
    kept_blocks: int | None       # blocks any exact kernel must compute (None: not counted)
    steps: int                    # ring steps K/V travel through (1: no ring)

    @property
    def work(self) -> np.ndarray:
        """float [device]: blocks (of all heads) each device computes."""
        return self.step_work.sum(axis=1)

    @property
    def computed_blocks(self) -> float:
        return float(self.work.sum())

    @property
    def efficiency(self) -> float:
        """kept / (sp x critical path): 1 when nothing but needed blocks is computed, evenly."""
        if self.kept_blocks is None or not self.critical_path:
            return 1.0
        return self.kept_blocks / (len(self.work) * self.critical_path)


# [device, ring step] -> [query shard, K/V shard] (plan/attention_work.py reads it here too)
by_pair = shard_pairs.by_pair


def _static_pairs(spec, layout, seq_len, sp, block, chunked_documents: bool) -> np.ndarray:
    """bool [query shard, K/V shard]: pairs the static mask keeps (shard_pairs.pair_active);
    with documents a chunked mask runs as the causal window a chunk spans (ring.prepare)."""
    if chunked_documents:
        spec = masks.within_chunk_window(spec)
    return shard_pairs.static_pairs(spec, layout, seq_len, sp, block, block)


def strategy_schedule(strategy, spec: masks.MaskSpec, layout: str, seq_len: int, sp: int, block: int,
                      segment_ids, *, count_kept: bool = True, positions=None) -> StrategySchedule:
    """The schedule of `strategy` (an ops.strategy.Strategy) on natural-order rows of packed
    documents `segment_ids` [rows, S], as `tables.document_schedule` takes them."""
    schedule = tables_lib.document_schedule(spec, layout, seq_len, sp, block, segment_ids,
                                            count_kept=count_kept, positions=positions)
    return from_ring_schedule(strategy, schedule, spec, layout, seq_len, sp, block)


def from_ring_schedule(strategy, schedule: tables_lib.DocumentSchedule, spec: masks.MaskSpec,
                       layout: str, seq_len: int, sp: int, block: int) -> StrategySchedule:
    """The schedule of `strategy` from the ring's on the same rows (`tables.document_schedule`
    with the same arguments): every strategy computes the ring's pairs, so one ring schedule
    prices them all (the planner computes it once per layout, sp and block)."""
    # The ring of groups visits every step the static mask needs (ulysses.group_steps), whatever
    # the documents need: it does not stop early as the ring does.
    static = _static_pairs(spec, layout, seq_len, sp, block, spec.chunk is not None)
    return strategy.from_step_blocks(schedule.computed_blocks, float(schedule.critical_path),
                                     schedule.kept_blocks, len(schedule.visited_steps), static)


def all_pairs_at_once(strategy, per_step: np.ndarray, kept: int | None) -> StrategySchedule:
    """The schedule of a strategy whose device computes all its pairs in one step, each device
    on its own (all-gather, halo): its work is the sum of its pairs' blocks, and no device waits
    for another's."""
    work = by_pair(per_step).sum(axis=1).astype(float)
    return StrategySchedule(strategy.name, 1, work[:, None], float(work.max()), kept, 1)
