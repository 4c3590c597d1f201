"""The ring step in plain XLA: block-sparse online softmax, recomputation in the backward.

Same contract as splash.py (see ring.py for shapes): the step's normalised output and
logsumexp in the forward; in the backward, the step's dQ added into the ring's float32
accumulator, and its float32 dK/dV. The step visits, one at a time, exactly the (q block,
kv block) pairs that are live in some batch row (the static mask keeps them and the segment ids
give their queries and keys a common document; tables.step_pairs, row-major, built on device):
a loop of data-dependent length, so it computes what splash does and a balanced layout costs no
more work than a contiguous one. Inside a pair the mask is applied element by element from
global positions and segment ids, except on a block the static mask keeps whole when there are
no documents. Memory per device is O(b * n * L) for the running statistics plus a few block
pairs of logits (the backward carries one pair's dS into the next iteration).

Inside the step the operands are head-major ([b, k, g, L, h], K/V [b, k, L, h]), transposed
once per step, so that every block product is a plain batched matmul with no transposes of its
own (on CPU, causal 8K, sp=4: forward 646 -> 331 ms with the pair list and this layout).

Letters: b batch, t query positions (one q block), s key positions (one kv block), k kv heads,
g query heads per kv head, h head_dim.
"""
from __future__ import annotations

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


class _Step:
    """One ring step's operands, head-major, its live pairs, and how to cut a block out."""

    def __init__(self, cfg, q, k, v, qs, ks, blocks, live):
        self.cfg, self.qs, self.ks, self.blocks = cfg, qs, ks, blocks
        self.kvh = k.shape[2]
        self.q = _heads_major(q, self.kvh)
        self.k, self.v = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)
        self.pairs, self.count = tables.step_pairs(jnp.any(live, axis=0), cfg.tables.max_pairs)

    def q_block(self, x, i):
        """Query block i of a head-major [b, k, g, L, ...] array."""
        return lax.dynamic_slice_in_dim(x, i * self.cfg.bq, self.cfg.bq, 3)

    def kv_block(self, x, j):
        """Key block j of a [b, k, L, h] array."""
        return lax.dynamic_slice_in_dim(x, j * self.cfg.bkv, self.cfg.bkv, 2)

    def logits(self, i, j):
        """Raw logits [b, k, g, t, s] (float32) of pair (i, j)."""
        return jnp.einsum("bkgth,bksh->bkgts", self.q_block(self.q, i), self.kv_block(self.k, j),
                          preferred_element_type=f32)

    def logits_t(self, i, j):
        """The same transposed, [b, k, s, g, t]: the backward's layout, in which three of its
        four block products read their operands as stored (in the ring on CPU at 8K, causal and
        with documents: fwd+bwd 3-7% faster than with [.., t, s])."""
        return jnp.einsum("bksh,bkgth->bksgt", self.kv_block(self.k, j), self.q_block(self.q, i),
                          preferred_element_type=f32)

    def masked(self, i, j, x, fill, transposed=False):
        """x [b, k, g, t, s] (transposed: [b, k, s, g, t]) with `fill` where pair (i, j)'s mask
        is False."""
        cfg, bq, bkv = self.cfg, self.cfg.bq, self.cfg.bkv

        def apply():
            qp = lax.dynamic_slice_in_dim(self.blocks.q_positions, i * bq, bq, 0)
            kp = lax.dynamic_slice_in_dim(self.blocks.kv_positions, j * bkv, bkv, 0)
            mask = cfg.spec.allowed(qp[:, None], kp[None, :])[None]  # [1, t, s]
            if self.qs is not None:
                qsi = lax.dynamic_slice_in_dim(self.qs, i * bq, bq, 1)
                ksj = lax.dynamic_slice_in_dim(self.ks, j * bkv, bkv, 1)
                mask = mask & (qsi[:, :, None] == ksj[:, None, :])  # [b, t, s]
            mask = jnp.swapaxes(mask, 1, 2)[:, None, :, None] if transposed else mask[:, None, None]
            return jnp.where(mask, x, fill)

        if self.qs is not None:
            return apply()
        return lax.cond(self.blocks.classes[i, j] == 2, lambda: x, apply)  # full: nothing masked


def _cap(cfg, raw):
    return raw if cfg.soft_cap is None else cfg.soft_cap * jnp.tanh(raw / cfg.soft_cap)


def _add_block(total, part, start, axis):
    return lax.dynamic_update_slice_in_dim(
        total, lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis) + part, start, axis)


def fwd_step(cfg, q, k, v, qs, ks, blocks, live):
    step = _Step(cfg, q, k, v, qs, ks, blocks, live)
    bq = cfg.bq

    def visit(p, carry):
        m_all, l_all, o_all = carry
        i, j = step.pairs[p, 0], step.pairs[p, 1]
        s = step.masked(i, j, _cap(cfg, step.logits(i, j)), -jnp.inf)
        m, l, o = step.q_block(m_all, i), step.q_block(l_all, i), step.q_block(o_all, i)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # row still empty: keep exp() finite
        prob = jnp.exp(s - safe[..., None])
        alpha = jnp.exp(m - safe)
        pv = jnp.einsum("bkgts,bksh->bkgth", prob.astype(v.dtype), step.kv_block(step.v, j),
                        preferred_element_type=f32)
        update = lambda total, block: lax.dynamic_update_slice_in_dim(total, block, i * bq, 3)  # noqa: E731
        return (update(m_all, m_new), update(l_all, alpha * l + prob.sum(-1)),
                update(o_all, o * alpha[..., None] + pv))

    stats = step.q.shape[:4]  # [b, k, g, L]
    init = vary_like((jnp.full(stats, -jnp.inf, f32), jnp.zeros(stats, f32),
                      jnp.zeros(step.q.shape, f32)), q)
    m, l, o = lax.fori_loop(0, step.count, visit, init)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return _heads_minor(o), _heads_minor(lse)


def bwd_step(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq):
    step = _Step(cfg, q, k, v, qs, ks, blocks, live)
    kvh, bq, bkv = step.kvh, cfg.bq, cfg.bkv
    do, lse, di = _heads_major(do, kvh), _heads_major(lse, kvh), _heads_major(di, kvh)

    # dK and dV read a pair's dS as it is computed ([.., s, t]); dQ needs it transposed. Made in
    # the same iteration, XLA fuses that transpose with the arithmetic producing dS and computes
    # it element by element with strided reads (on CPU ~3x the time of a block product). So dQ
    # of each pair is computed one iteration later, from the dS the loop carried: a plain
    # transpose of a stored array (fwd+bwd 22-32% faster at 8K on CPU, causal and GQA).
    def add_dq(dq_all, pending):
        ds, i, j = pending
        dq = jnp.einsum("bksgt,bksh->bkgth", ds, step.kv_block(step.k, j), preferred_element_type=f32)
        return _add_block(dq_all, dq, i * bq, 3)

    def visit(p, carry):
        dq_all, dk_all, dv_all, pending = carry
        dq_all = add_dq(dq_all, pending)
        i, j = step.pairs[p, 0], step.pairs[p, 1]
        # Everything [b, k, s, g, t]: see _Step.logits_t.
        raw = step.logits_t(i, j)
        row = lambda x: step.q_block(x, i)[:, :, None]  # noqa: E731  [b, k, 1, g, t]
        # Recompute the probabilities from the stored global logsumexp.
        prob = step.masked(i, j, jnp.exp(_cap(cfg, raw) - row(lse)), 0.0, transposed=True)
        do_i, q_i = step.q_block(do, i), step.q_block(step.q, i)
        dv = jnp.einsum("bksgt,bkgth->bksh", prob.astype(do.dtype), do_i, preferred_element_type=f32)
        dp = jnp.einsum("bksh,bkgth->bksgt", step.kv_block(step.v, j), do_i,
                        preferred_element_type=f32)
        ds = prob * (dp - row(di))
        if cfg.soft_cap is not None:  # d cap(x)/dx = 1 - tanh(x / cap)^2
            ds = ds * (1.0 - jnp.square(jnp.tanh(raw / cfg.soft_cap)))
        ds = ds.astype(q.dtype)
        dk = jnp.einsum("bksgt,bkgth->bksh", ds, q_i, preferred_element_type=f32)
        return (dq_all, _add_block(dk_all, dk, j * bkv, 2), _add_block(dv_all, dv, j * bkv, 2),
                (ds, i, j))

    b, n = q.shape[0], q.shape[2]
    nothing_pending = (vary_like(jnp.zeros((b, kvh, bkv, n // kvh, bq), q.dtype), q),
                       *vary_like((jnp.int32(0), jnp.int32(0)), step.pairs))  # (dS 0, pair (0, 0))
    init = (_heads_major(dq, kvh),) + vary_like((jnp.zeros(step.k.shape, f32),
                                                 jnp.zeros(step.k.shape, f32)), q) + (nothing_pending,)
    dq, dk, dv, pending = lax.fori_loop(0, step.count, visit, init)
    dq = add_dq(dq, pending)  # the last pair's
    return _heads_minor(dq), jnp.moveaxis(dk, 2, 1), jnp.moveaxis(dv, 2, 1)
