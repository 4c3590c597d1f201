"""The ring step in plain XLA: block-sparse online softmax, recomputation in the backward.

Same contract as splash.py (see ring.py for shapes): the step's normalised output and
logsumexp in the forward; in the backward, the step's dQ added into the ring's float32
accumulator, and its float32 dK/dV. The step visits the (q block, kv block) pairs the mask
keeps (tables.step_pairs: row-major, built on device) one at a time and computes a pair only
when it is live in some batch row (the segment ids give its queries and keys a common
document), so it computes exactly the blocks splash does and a balanced layout costs no more
work than a contiguous one. Inside a pair the mask is applied element by element from global
positions and segment ids. Memory per device is O(b * n * L) for the running statistics plus
one block pair of logits.

Letters: b batch, t query positions (one q block), s key positions (one kv block), k kv heads,
g query heads per kv head, h head_dim.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from longctx.ops import tables
from longctx.ops.shmap import vary_like

f32 = jnp.float32


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _update(x, block, start, axis):
    return lax.dynamic_update_slice_in_dim(x, block, start, axis)


class _Step:
    """The fixed inputs of one ring step, and how to cut the pair (i, j) out of them."""

    def __init__(self, cfg, q, k, v, qs, ks, blocks, live):
        self.cfg, self.live = cfg, live
        b, L, n, h = q.shape
        self.kvh = k.shape[2]
        self.q5 = q.reshape(b, L, self.kvh, n // self.kvh, h)
        self.k, self.v, self.qs, self.ks = k, v, qs, ks
        self.qpos, self.kpos = blocks.q_positions, blocks.kv_positions  # global positions
        self.pairs, self.valid = tables.step_pairs(blocks.classes, cfg.tables.max_pairs)

    def pair(self, p):
        """(i, j, live): the pair's q block, kv block, and whether any row computes it."""
        i, j = self.pairs[p, 0], self.pairs[p, 1]
        return i, j, self.valid[p] & jnp.any(self.live[:, i, j])

    def logits(self, i, j):
        """Raw logits [b, k, g, t, s] (float32) of pair (i, j) and its mask, broadcastable."""
        cfg = self.cfg
        qi = _slice(self.q5, i * cfg.bq, cfg.bq, 1)
        kj = _slice(self.k, j * cfg.bkv, cfg.bkv, 1)
        raw = jnp.einsum("btkgh,bskh->bkgts", qi, kj, preferred_element_type=f32)
        qp, kp = _slice(self.qpos, i * cfg.bq, cfg.bq, 0), _slice(self.kpos, j * cfg.bkv, cfg.bkv, 0)
        mask = cfg.spec.allowed(qp[:, None], kp[None, :])[None]  # [1, t, s]
        if self.qs is not None:
            qsi, ksj = _slice(self.qs, i * cfg.bq, cfg.bq, 1), _slice(self.ks, j * cfg.bkv, cfg.bkv, 1)
            mask = mask & (qsi[:, :, None] == ksj[:, None, :])  # [b, t, s]
        return raw, mask[:, None, None]


def _cap(cfg, raw):
    return raw if cfg.soft_cap is None else cfg.soft_cap * jnp.tanh(raw / cfg.soft_cap)


def _to_btn(x):
    """[b, k, g, t] -> [b, t, k * g]."""
    b, kvh, g, L = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, L, kvh * g)


def _to_bkgt(x, kvh):
    """[b, t, n] -> [b, k, g, t]."""
    b, L, n = x.shape
    return jnp.moveaxis(x.reshape(b, L, kvh, n // kvh), 1, 3)


def fwd_step(cfg, q, k, v, qs, ks, blocks, live):
    b, L, n, h = q.shape
    step = _Step(cfg, q, k, v, qs, ks, blocks, live)
    kvh, bq = step.kvh, cfg.bq

    def visit(p, carry):
        i, j, is_live = step.pair(p)

        def run():
            m_all, l_all, o_all = carry
            m, l = _slice(m_all, i * bq, bq, 3), _slice(l_all, i * bq, bq, 3)
            o = _slice(o_all, i * bq, bq, 1)
            raw, mask = step.logits(i, j)
            s = jnp.where(mask, _cap(cfg, raw), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # row still empty: keep exp() finite
            prob = jnp.exp(s - safe[..., None])
            alpha = jnp.exp(m - safe)
            vj = _slice(v, j * cfg.bkv, cfg.bkv, 1)
            pv = jnp.einsum("bkgts,bskh->btkgh", prob.astype(v.dtype), vj, preferred_element_type=f32)
            o = o * jnp.moveaxis(alpha, 3, 1)[..., None] + pv
            return (_update(m_all, m_new, i * bq, 3), _update(l_all, alpha * l + prob.sum(-1), i * bq, 3),
                    _update(o_all, o, i * bq, 1))

        return lax.cond(is_live, run, lambda: carry)

    init = vary_like((jnp.full((b, kvh, n // kvh, L), -jnp.inf, f32),
                      jnp.zeros((b, kvh, n // kvh, L), f32),
                      jnp.zeros((b, L, kvh, n // kvh, h), f32)), q)
    m, l, o = lax.fori_loop(0, step.pairs.shape[0], visit, init)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    o = o / jnp.moveaxis(jnp.where(l > 0, l, 1.0), 3, 1)[..., None]
    return o.reshape(b, L, n, h), _to_btn(lse)


def bwd_step(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq):
    b, L, n, h = q.shape
    step = _Step(cfg, q, k, v, qs, ks, blocks, live)
    kvh, bq, bkv = step.kvh, cfg.bq, cfg.bkv
    do5 = do.reshape(step.q5.shape)
    lse4, di4 = _to_bkgt(lse, kvh), _to_bkgt(di, kvh)

    def visit(p, carry):
        i, j, is_live = step.pair(p)

        def run():
            dq_all, dk_all, dv_all = carry
            raw, mask = step.logits(i, j)
            # Recompute the probabilities from the stored global logsumexp.
            lse_i, di_i = _slice(lse4, i * bq, bq, 3), _slice(di4, i * bq, bq, 3)
            prob = jnp.where(mask, jnp.exp(_cap(cfg, raw) - lse_i[..., None]), 0.0)
            do_i, q_i = _slice(do5, i * bq, bq, 1), _slice(step.q5, i * bq, bq, 1)
            k_j, v_j = _slice(k, j * bkv, bkv, 1), _slice(v, j * bkv, bkv, 1)
            dv = jnp.einsum("bkgts,btkgh->bskh", prob.astype(do.dtype), do_i, preferred_element_type=f32)
            dp = jnp.einsum("btkgh,bskh->bkgts", do_i, v_j, preferred_element_type=f32)
            ds = prob * (dp - di_i[..., None])
            if cfg.soft_cap is not None:  # d cap(x)/dx = 1 - tanh(x / cap)^2
                ds = ds * (1.0 - jnp.square(jnp.tanh(raw / cfg.soft_cap)))
            dq = jnp.einsum("bkgts,bskh->btkgh", ds.astype(k.dtype), k_j, preferred_element_type=f32)
            dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(q.dtype), q_i, preferred_element_type=f32)
            add = lambda total, part, start: _update(  # noqa: E731
                total, _slice(total, start, part.shape[1], 1) + part, start, 1)
            return add(dq_all, dq, i * bq), add(dk_all, dk, j * bkv), add(dv_all, dv, j * bkv)

        return lax.cond(is_live, run, lambda: carry)

    init = (dq.reshape(step.q5.shape),) + vary_like((jnp.zeros(k.shape, f32),
                                                     jnp.zeros(k.shape, f32)), q)
    dq, dk, dv = lax.fori_loop(0, step.pairs.shape[0], visit, init)
    return dq.reshape(b, L, n, h), dk, dv
