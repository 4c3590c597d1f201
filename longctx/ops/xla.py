"""The ring step in plain XLA: block-sparse online softmax, recomputation in the backward.

The backend interface of ring.py (shapes there). The forward's accumulator is the online
softmax itself (running max, sum and unnormalised output), carried from step to step and
normalised once at the end; the backward's are dQ and the float32 dK/dV travelling with K/V.
A step visits, one at a time, exactly the live blocks (the static mask keeps them and the
segment ids give their queries and keys a common document; tables.step_pairs, built on
device): a loop of data-dependent length, so it computes what splash does and a balanced
layout costs no more work than a contiguous one. Without documents every batch row has the
same blocks, and a visit computes one (q block, kv block) pair for all rows; with documents
the rows differ, and a visit computes one block of one row, so that a pair live in one row is
not computed for the others (step_visits). Inside a block the mask is applied element by
element from global positions and segment ids, except on a block the static mask keeps whole
when there are no documents. Memory per device is O(b * n * L) for the running
statistics plus a few blocks of logits (the backward carries one visit's dS into the next
iteration).

The operands are head-major ([b, k, g, L, h]; K/V, which travel so, [b, k, L, h]), transposed
once per call, so that every block product is a plain batched matmul with no transposes of its
own (on CPU, causal 8K, sp=4: forward 646 -> 331 ms with the pair list and this layout), and a
step makes no pass over the shard beyond its blocks.

Letters: b batch, t query positions (one q block), s key positions (one kv block), k kv heads,
g query heads per kv head, h head_dim.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from longctx.ops import tables
from longctx.ops.shmap import vary_like

f32 = jnp.float32


def _heads_major(x, kvh):
    """[b, L, n, ...] -> [b, k, g, L, ...] (n = k * g)."""
    b, L, n = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, L, kvh, n // kvh, *x.shape[3:]), 1, 3)


def _heads_minor(x):
    """[b, k, g, L, ...] -> [b, L, n, ...]: the inverse of _heads_major."""
    b, kvh, g, L = x.shape[:4]
    return jnp.moveaxis(x, 3, 1).reshape(b, L, kvh * g, *x.shape[4:])


class Visit(NamedTuple):
    """One block of the step: batch rows r .. r + rows - 1 (rows static), q block i, kv block j."""
    rows: int
    r: jax.Array
    i: jax.Array
    j: jax.Array


class Visits(NamedTuple):
    """The step's blocks: index int32 [most, 3] (row, q block, kv block), `count` of them real,
    each computed for `rows` batch rows from its row on."""
    rows: int
    index: jax.Array
    count: jax.Array

    def at(self, p) -> Visit:
        """Visit p."""
        return Visit(self.rows, self.index[p, 0], self.index[p, 1], self.index[p, 2])


def step_visits(live, batch: int, max_pairs: int) -> Visits:
    """The live blocks of a step (live bool [1 or b, q_blocks, kv_blocks]) as visits. Without
    documents the rows share one set of blocks: each visit computes all rows. With documents
    each visit computes one row's block, for that row only. That is faster even where every row
    needs the block: bench_ring's docs9 (batch 2), fwd+bwd on CPU, 192 -> 148 ms at S = 2048
    (every live block live in both rows) and 1,275 -> 924 ms at 8,192 (99 blocks of one row
    instead of 126), against computing each block live in some row for both."""
    rows = batch if live.shape[0] == 1 else 1
    return Visits(rows, *tables.step_pairs(live, live.shape[0] * max_pairs))


class _Step:
    """One ring step's operands (q [b, k, g, L, h], K/V [b, k, L, h]), its visits, and how to
    cut a visit's block out."""

    def __init__(self, cfg, q, k, v, qs, ks, blocks, live):
        self.cfg, self.q, self.k, self.v, self.blocks = cfg, q, k, v, blocks
        self.qs, self.ks = tables.ids_of(qs), tables.ids_of(ks)
        self.kvh = k.shape[1]
        self.visits = step_visits(live, q.shape[0], cfg.tables.max_pairs)

    @staticmethod
    def _cut(x, at: Visit, axis, start, size):
        x = lax.dynamic_slice_in_dim(x, at.r, at.rows, 0)
        return lax.dynamic_slice_in_dim(x, start, size, axis)

    @staticmethod
    def _put(total, part, at: Visit, axis, start):
        starts = [0] * total.ndim
        starts[0], starts[axis] = at.r, start
        return lax.dynamic_update_slice(total, part, starts)

    def q_block(self, x, at: Visit):
        """The visit's query block of a head-major [b, k, g, L, ...] array."""
        return self._cut(x, at, 3, at.i * self.cfg.bq, self.cfg.bq)

    def kv_block(self, x, at: Visit):
        """The visit's key block of a [b, k, L, h] array."""
        return self._cut(x, at, 2, at.j * self.cfg.bkv, self.cfg.bkv)

    def set_q_block(self, total, part, at: Visit):
        """`total` (head-major) with the visit's query block replaced by `part`."""
        return self._put(total, part, at, 3, at.i * self.cfg.bq)

    def add_q_block(self, total, part, at: Visit):
        return self.set_q_block(total, self.q_block(total, at) + part, at)

    def add_kv_block(self, total, part, at: Visit):
        """`total` [b, k, L, h] with `part` added to the visit's key block."""
        return self._put(total, self.kv_block(total, at) + part, at, 2, at.j * self.cfg.bkv)

    def logits(self, at: Visit):
        """Raw logits [rows, k, g, t, s] (float32) of the visit."""
        return jnp.einsum("bkgth,bksh->bkgts", self.q_block(self.q, at), self.kv_block(self.k, at),
                          preferred_element_type=f32)

    def logits_t(self, at: Visit):
        """The same transposed, [rows, k, s, g, t]: the backward's layout, in which three of its
        four block products read their operands as stored (in the ring on CPU at 8K, causal and
        with documents: fwd+bwd 3-7% faster than with [.., t, s])."""
        return jnp.einsum("bksh,bkgth->bksgt", self.kv_block(self.k, at), self.q_block(self.q, at),
                          preferred_element_type=f32)

    def masked(self, at: Visit, x, fill, transposed=False):
        """x [rows, k, g, t, s] (transposed: [rows, k, s, g, t]) with `fill` where the visit's
        mask is False."""
        cfg, bq, bkv = self.cfg, self.cfg.bq, self.cfg.bkv

        def apply():
            if self.blocks.q_positions.ndim == 2:  # a per-row layout: positions [b, L]
                qp = self._cut(self.blocks.q_positions, at, 1, at.i * bq, bq)
                kp = self._cut(self.blocks.kv_positions, at, 1, at.j * bkv, bkv)
                mask = cfg.spec.allowed(qp[:, :, None], kp[:, None, :])  # [rows, t, s]
            else:
                qp = lax.dynamic_slice_in_dim(self.blocks.q_positions, at.i * bq, bq, 0)
                kp = lax.dynamic_slice_in_dim(self.blocks.kv_positions, at.j * bkv, bkv, 0)
                mask = cfg.spec.allowed(qp[:, None], kp[None, :])[None]  # [1, t, s]
            if self.qs is not None:
                qsi = self._cut(self.qs, at, 1, at.i * bq, bq)
                ksj = self._cut(self.ks, at, 1, at.j * bkv, bkv)
                mask = mask & (qsi[:, :, None] == ksj[:, None, :])  # [rows, t, s]
            mask = jnp.swapaxes(mask, 1, 2)[:, None, :, None] if transposed else mask[:, None, None]
            return jnp.where(mask, x, fill)

        if self.qs is not None:
            return apply()
        # full: nothing masked
        return lax.cond(self.blocks.classes[at.i, at.j] == 2, lambda: x, apply)


def _cap(cfg, raw):
    return raw if cfg.soft_cap is None else cfg.soft_cap * jnp.tanh(raw / cfg.soft_cap)


def to_kv_layout(x):
    """K, V (and dK, dV) from the ring's [b, L, k, h] to the [b, k, L, h] they travel the ring
    in: transposed once per call, not once per step."""
    return jnp.moveaxis(x, 1, 2)


def from_kv_layout(x):
    return jnp.moveaxis(x, 2, 1)


class FwdContext(NamedTuple):
    """What every forward step reads: q head-major, the query segment ids and the sink logits
    ([k, g] float32, or None)."""
    q: jax.Array
    qs: jax.Array | None
    sinks: jax.Array | None


def fwd_start(cfg, q, qs, kv_heads, sinks=None):
    """(context, accumulator) of the forward: the online softmax's running max, sum and
    unnormalised output ([b, k, g, L(, h)] float32), carried from step to step and normalised
    once, in fwd_end. Sinks start it: each is a first logit with no value (max = sink, sum 1)."""
    q = _heads_major(q, kv_heads)
    if sinks is not None:
        sinks = sinks.astype(f32).reshape(kv_heads, -1)
    ctx = FwdContext(q, qs, sinks)
    return ctx, _empty_forward(ctx)


def _empty_forward(ctx):
    q = ctx.q
    stats = q.shape[:4]  # [b, k, g, L]
    if ctx.sinks is None:
        m, l = jnp.full(stats, -jnp.inf, f32), jnp.zeros(stats, f32)
    else:
        m, l = jnp.broadcast_to(ctx.sinks[None, :, :, None], stats), jnp.ones(stats, f32)
    return vary_like((m, l, jnp.zeros(q.shape, f32)), q)


def fwd_step(cfg, ctx: FwdContext, acc, k, v, ks, blocks, live, run):
    """The accumulator after this step's live blocks (K/V in the travelling layout). `run` is
    True exactly where the step has a live block; where it is False the step is skipped whole,
    not as an empty loop (which still builds the visit list: for the contiguous causal ring at
    S = 2,048, sp = 4, one block per shard, skipping whole took fwd+bwd on one CPU core from
    ~175 to ~115 ms)."""
    step = _Step(cfg, ctx.q, k, v, ctx.qs, ks, blocks, live)
    if acc is None:  # the ring's one step: its accumulator starts here
        acc = _empty_forward(ctx)

    def visit(at: Visit, carry):
        m_all, l_all, o_all = carry
        s = step.masked(at, _cap(cfg, step.logits(at)), -jnp.inf)
        m, l, o = (step.q_block(x, at) for x in (m_all, l_all, o_all))
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # row still empty: keep exp() finite
        prob = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(m - safe)
        pv = jnp.einsum("bkgts,bksh->bkgth", prob.astype(v.dtype), step.kv_block(step.v, at),
                        preferred_element_type=f32)
        update = lambda total, block: step.set_q_block(total, block, at)  # noqa: E731
        return (update(m_all, m_new), update(l_all, alpha * l + prob.sum(-1)),
                update(o_all, o * alpha[..., None] + pv))

    visits = step.visits
    return lax.cond(run, lambda: lax.fori_loop(0, visits.count,
                                               lambda p, carry: visit(visits.at(p), carry), acc),
                    lambda: acc)


def fwd_end(cfg, ctx: FwdContext, acc):
    """(out float32 [b, L, n, h], lse [b, L, n]) from the accumulator; -inf lse and zero output
    for rows that attended to nothing."""
    m, l, o = acc
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return _heads_minor(o), _heads_minor(lse)


class BwdContext(NamedTuple):
    """What every backward step reads, head-major: q, its segment ids, the forward's
    logsumexp, dO and di = rowsum(dO x O)."""
    q: jax.Array
    qs: jax.Array | None
    lse: jax.Array
    do: jax.Array
    di: jax.Array


def bwd_start(cfg, q, qs, lse, do, di, kv_heads):
    """(context, dQ accumulator [b, k, g, L, h] float32) of the backward."""
    major = lambda x: _heads_major(x, kv_heads)  # noqa: E731
    ctx = BwdContext(major(q), qs, major(lse), major(do), major(di))
    return ctx, vary_like(jnp.zeros(ctx.q.shape, f32), q)


def bwd_step(cfg, ctx: BwdContext, acc, k, v, ks, blocks, live, run):
    """(dQ, dK, dV) accumulators after this step's live blocks: dQ in bwd_start's layout, dK and
    dV (float32) in the travelling layout of K and V. `run`: as in fwd_step; the step's first
    visit relies on it (a step that runs has one)."""
    step = _Step(cfg, ctx.q, k, v, ctx.qs, ks, blocks, live)
    do, lse, di = ctx.do, ctx.lse, ctx.di
    if acc[0] is None:  # the ring's one step: its accumulators start here
        acc = vary_like((jnp.zeros(ctx.q.shape, f32), jnp.zeros(k.shape, f32),
                         jnp.zeros(v.shape, f32)), ctx.q)

    # dK and dV read a visit's dS as it is computed ([.., s, t]); dQ needs it transposed. Made in
    # the same iteration, XLA fuses that transpose with the arithmetic producing dS and computes
    # it element by element with strided reads (on CPU ~3x the time of a block product). So dQ
    # of each visit is computed one iteration later, from the dS the loop carried: a plain
    # transpose of a stored array (fwd+bwd 22-32% faster at 8K on CPU, causal and GQA).
    def add_dq(dq_all, pending, rows):
        ds, index = pending
        at = Visit(rows, *index)
        dq = jnp.einsum("bksgt,bksh->bkgth", ds, step.kv_block(step.k, at),
                        preferred_element_type=f32)
        return step.add_q_block(dq_all, dq, at)

    def visit(at: Visit, dq_all, dk_all, dv_all):
        """The accumulators after this visit, but for its dQ: (dq, dk, dv, pending)."""
        # Everything [rows, k, s, g, t]: see _Step.logits_t.
        raw = step.logits_t(at)
        row = lambda x: step.q_block(x, at)[:, :, None]  # noqa: E731  [rows, k, 1, g, t]
        # Recompute the probabilities from the stored global logsumexp.
        prob = step.masked(at, jnp.exp(_cap(cfg, raw) - row(lse)), 0.0, transposed=True)
        do_i, q_i = step.q_block(do, at), step.q_block(step.q, at)
        dv = jnp.einsum("bksgt,bkgth->bksh", prob.astype(do.dtype), do_i, preferred_element_type=f32)
        dp = jnp.einsum("bksh,bkgth->bksgt", step.kv_block(step.v, at), do_i,
                        preferred_element_type=f32)
        ds = prob * (dp - row(di))
        if cfg.soft_cap is not None:  # d cap(x)/dx = 1 - tanh(x / cap)^2
            ds = ds * (1.0 - jnp.square(jnp.tanh(raw / cfg.soft_cap)))
        ds = ds.astype(step.q.dtype)
        dk = jnp.einsum("bksgt,bkgth->bksh", ds, q_i, preferred_element_type=f32)
        return (dq_all, step.add_kv_block(dk_all, dk, at), step.add_kv_block(dv_all, dv, at),
                (ds, (at.r, at.i, at.j)))

    visits = step.visits

    def next_visit(p, carry):
        dq_all, dk_all, dv_all, pending = carry
        return visit(visits.at(p), add_dq(dq_all, pending, visits.rows), dk_all, dv_all)

    def visit_all():
        # The first visit is taken out of the loop: it has no previous dS to add.
        carry = visit(visits.at(0), *acc)
        dq, dk, dv, pending = lax.fori_loop(1, visits.count, next_visit, carry)
        return add_dq(dq, pending, visits.rows), dk, dv  # the last visit's dQ

    return lax.cond(run, visit_all, lambda: acc)


def bwd_end(cfg, ctx: BwdContext, dq):
    """dQ [b, L, n, h] float32 from the accumulator."""
    return _heads_minor(dq)
