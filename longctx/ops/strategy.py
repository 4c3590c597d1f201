"""A context-parallel strategy: one way to split attention over the sp axis, as one object.

Each strategy is a class in a module of its own (ring_strategy.py, all_gather.py, ulysses.py,
usp.py, halo.py) and one line of `context_parallel.REGISTRY`. Its object answers everything the
model, the planner, the memory model and the reports ask of it; none of them compares names:

  what it runs    forward, backward: this device's shard, inside shard_map (ring.py's interface)
  its schedule    from_step_blocks: the blocks each device computes at each of its steps, from
                  the ring's blocks per (device, ring step) pair (strategy_schedule.py);
                  dead_grid_steps: the grid steps its kernels walk with nothing live
  its price       transfers: the bytes of each collective kind per pass, how many calls, over
                  how many devices, and whether they run under the blocks (the one account of
                  what overlaps: plan/step_time.py prices it, the planner's ties read its
                  result); kernel_calls per pass; working_bytes per device

Every method is abstract: a class that lacks one cannot be made, so nothing falls through to
another strategy's price (`AnyHeads` holds the three that a strategy splitting the sequence alone
answers with "anything goes"). The planner's preferences are class attributes: `simplicity`,
which every strategy sets (context_parallel refuses one that does not), and `takes_degree`,
`layout_matters`, `local_masks_only`, whose defaults fit a strategy that splits the sequence
alone.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Sequence

import numpy as np

@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention call over sp: per device b x L = S/sp tokens of n heads (kv_heads K/V heads)
    of head_dim, `dtype_bytes` per element of Q, K, V, out (2: bf16); documents: int32 segment ids
    travel with K/V."""
    batch: int
    seq_len: int
    sp: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    documents: bool = False

    @property
    def shard_len(self) -> int:
        return self.seq_len // self.sp

    @property
    def kv_bytes(self) -> int:
        """One of K or V of this device's shard, in the compute dtype."""
        return self.batch * self.shard_len * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv32_bytes(self) -> int:
        """One of dK or dV of this device's shard, float32."""
        return self.batch * self.shard_len * self.kv_heads * self.head_dim * 4

    @property
    def ids_bytes(self) -> int:
        """The shard's K/V segment ids (int32), where documents travel with K/V."""
        return 4 * self.batch * self.shard_len if self.documents else 0


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective in one pass of one attention call, on one device."""
    kind: str            # "permute", "all_gather", "reduce_scatter" or "all_to_all"
    sent: int            # bytes one device sends (= receives), as a bandwidth-optimal algorithm
    calls: float         # collectives of this kind the pass issues: each pays a launch latency
    group: int           # devices in each collective (a permute: its sender and its receiver, 2)
    under_blocks: bool   # issued while blocks that do not need it compute: hides behind them
    stride: int = 1      # a permute's distance along the sp ring's cycle, in devices


def ring_sends(steps: Sequence[int], size: int) -> tuple[int, int]:
    """(sends, final distance) of K/V visiting `steps` (ascending) of a ring of `size`: one send
    per step after the first, one more to jump a gap (ring._ring_loop), none for step 0."""
    sends, pos = 0, 0
    for s in steps:
        if (s - pos) % size:
            sends += 1
        pos = s
    return sends, pos


@dataclasses.dataclass(frozen=True)
class Strategy(abc.ABC):
    """A context-parallel strategy (see the module docstring); `degree` is the Ulysses degree of
    a strategy that takes one (`takes_degree`), else None. Hashable: it keys the caches of the
    differentiable attention and of the planner's schedules."""
    degree: int | None = None

    name: ClassVar[str]              # attention.cp
    simplicity: ClassVar[int]        # the planner's tie rule: how much its price rests on, 0 least
    takes_degree: ClassVar[bool] = False     # attention.cp_ulysses is its Ulysses degree
    layout_matters: ClassVar[bool] = True    # whether the data layout changes its work
    local_masks_only: ClassVar[bool] = False  # the planner offers it only to window and chunked layers

    def __str__(self) -> str:
        return self.name if self.degree is None else f"{self.name} x{self.degree}"

    # ------------------------------------------------------------------------- what it runs

    @classmethod
    @abc.abstractmethod
    def candidates(cls, heads: int, sp: int) -> list[Strategy]:
        """Its instances that split `heads` query heads over an sp ring of `sp` devices."""

    @classmethod
    @abc.abstractmethod
    def config_problem(cls, heads: int, sp: int, degree, cp_key: str, degree_key: str) -> str | None:
        """The sentence refusing a config that names it with `heads` and `sp` (None: it runs);
        `cp_key`, `degree_key`: the config keys to name (attention.cp, attention.cp_ulysses)."""

    @abc.abstractmethod
    def check(self, heads: int, sp: int) -> None:
        """Raises ValueError when it cannot run `heads` query heads over `sp` devices."""

    @abc.abstractmethod
    def forward(self, cfg, q, k, v, qs, ks, aux):
        """(out [b, L, n, h] in q's dtype, lse [b, L, n] float32) of this device's shard
        (ring.RingConfig `cfg`, the kernels' segment ids, sink logits), inside shard_map."""

    @abc.abstractmethod
    def backward(self, cfg, res, do):
        """(dq, dk, dv, None, None, d_aux) from res = (q, k, v, qs, ks, aux, out, lse)."""

    # ------------------------------------------------------------------------- its schedule

    @abc.abstractmethod
    def from_step_blocks(self, per_step: np.ndarray, ring_critical_path: float, kept: int | None,
                         ring_steps: int, static_pairs: np.ndarray):
        """Its strategy_schedule.StrategySchedule from the blocks of every (device a, ring step s)
        pair `per_step` [sp, sp] (the pair (a, (a - s) mod sp)), the ring's own critical path and
        steps (which depend on where it stops), the kept blocks, and the pairs the static mask
        keeps (bool [query shard, K/V shard])."""

    @abc.abstractmethod
    def dead_grid_steps(self, live: np.ndarray) -> tuple[float, float]:
        """(rows, columns): the grid steps its critical path's kernel calls walk beyond their live
        blocks, from the static live blocks bool [device a, ring step s, q block, kv block]
        (plan/attention_work.py's GridSchedule says how splash sizes a grid)."""

    @abc.abstractmethod
    def steps_in_words(self, cfg) -> str:
        """What its K/V go through for the mask of `cfg`, for a report ("16 ring steps")."""

    # ------------------------------------------------------------------------- its price

    @abc.abstractmethod
    def transfers(self, shape: Shape, cfg, steps: Sequence[int] | None = None) -> dict:
        """{"forward" | "backward": (Transfer, ...)} of one call of `shape` with the static
        configuration `cfg` (ring.RingConfig: the mask, layout and blocks). `steps`: the ring steps
        its K/V visit (the ring's, or usp's ring of groups'; a schedule's, where documents stop
        them early); None: those the mask runs."""

    @abc.abstractmethod
    def kernel_calls(self, cfg, travelled: float) -> float:
        """Kernel calls per pass of one call on one device; `travelled`: the ring steps its K/V
        travel (StrategySchedule.steps, a mean over batches)."""

    @abc.abstractmethod
    def working_bytes(self, shape: Shape, cfg) -> float:
        """The largest attention arrays of one call on one device (forward and backward)."""


class AnyHeads:
    """What a strategy that splits the sequence, not the heads, asks of them: nothing. Any head
    count runs, there is one instance, and it takes no Ulysses degree."""

    @classmethod
    def candidates(cls, heads: int, sp: int) -> list[Strategy]:
        return [cls()]

    @classmethod
    def config_problem(cls, heads: int, sp: int, degree, cp_key: str, degree_key: str) -> str | None:
        return None

    def check(self, heads: int, sp: int) -> None:
        pass
