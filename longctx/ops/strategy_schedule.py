"""What each context-parallel strategy computes for given rows of documents (host, for reports and
the planner): the work of every device, the critical path, the ring steps K/V travel.

Every strategy computes the same (query shard, K/V shard) pairs, with the same live blocks
(ops/shard_pairs.py); `tables.document_schedule` counts them per (device, ring step), where ring
step s on device a is the pair (a, (a - s) mod sp). The strategies differ in who computes each
pair and what waits for what:

  ring        device a computes its pairs one ring step at a time; every step waits for the
              busiest device (the K/V pass on together)
  all_gather  device a computes all its pairs after one gather: no step waits for another device
  halo        the same pairs as all_gather, each after its own permute of the blocks it needs
  ulysses     every device computes every pair for 1/sp of the heads: all devices equal
  usp         at step s of the ring of groups, each device of group g computes the pairs of
              g's U query shards against group (g - s)'s U K/V shards for 1/U of the heads

Work is counted in blocks of all heads (a Ulysses device's pair for n/U heads counts 1/U), so
that every strategy's total is the same: the live blocks, which for packed rows are exactly the
kept blocks (the blocks holding a pair the mask and the documents allow).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from longctx.ops import masks, shard_pairs, ulysses
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


def strategy_schedule(strategy: str, degree: int | None, spec: masks.MaskSpec, layout: str,
                      seq_len: int, sp: int, block: int, segment_ids, *, count_kept: bool = True,
                      positions=None) -> StrategySchedule:
    """The schedule of `strategy` (with its Ulysses degree for usp) on natural-order rows of
    packed documents `segment_ids` [rows, S], as `tables.document_schedule` takes them."""
    schedule = tables_lib.document_schedule(spec, layout, seq_len, sp, block, segment_ids,
                                            count_kept=count_kept, positions=positions)
    return from_ring_schedule(strategy, degree, schedule, spec, layout, seq_len, sp, block)


def from_ring_schedule(strategy: str, degree: int | None, schedule: tables_lib.DocumentSchedule,
                       spec: masks.MaskSpec, layout: str, seq_len: int, sp: int,
                       block: int) -> StrategySchedule:
    """The schedule of `strategy` from the ring's on the same rows (`tables.document_schedule`
    with the same arguments): every strategy computes the ring's pairs, so one ring schedule
    prices them all (the planner computes it once per layout, sp and block)."""
    # The ring of groups visits every step the static mask needs (ulysses.group_steps), whatever
    # the documents need: it does not stop early as the ring does.
    static = _static_pairs(spec, layout, seq_len, sp, block, spec.chunk is not None)
    return from_step_blocks(strategy, degree, schedule.computed_blocks,
                            float(schedule.critical_path), schedule.kept_blocks,
                            len(schedule.visited_steps), static)


def from_step_blocks(strategy: str, degree: int | None, per_step: np.ndarray,
                     ring_critical_path: float, kept: int | None, ring_steps: int,
                     static_pairs: np.ndarray) -> StrategySchedule:
    """The schedule of `strategy` from the blocks of every (device a, ring step s) pair
    `per_step` [sp, sp], the ring's own critical path and steps (which depend on how it stops),
    and the pairs the static mask keeps (bool [query shard, K/V shard]: the usp ring's steps)."""
    sp = per_step.shape[0]
    pairs = by_pair(per_step)
    if strategy == "ring":
        return StrategySchedule(strategy, 1, per_step.astype(float), ring_critical_path, kept,
                                ring_steps)
    if strategy in ("all_gather", "halo"):
        work = pairs.sum(axis=1).astype(float)
        return StrategySchedule(strategy, 1, work[:, None], float(work.max()), kept, 1)
    degree = sp if strategy == "ulysses" else int(degree)
    groups = sp // degree
    shards = lambda g: slice(g * degree, (g + 1) * degree)  # noqa: E731
    # step_work[g, s]: blocks of group g's pairs at group step s, shared by its U devices
    step_work = np.array([[pairs[shards(g), shards((g - s) % groups)].sum() for s in range(groups)]
                          for g in range(groups)], float) / degree
    critical = float(sum(step_work[:, s].max() for s in range(groups)))
    visited = ulysses.steps_with_pairs(static_pairs, degree)
    return StrategySchedule(strategy, degree, np.repeat(step_work, degree, axis=0), critical, kept,
                            len(visited))
