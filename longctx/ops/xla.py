"""The ring step in plain XLA: KV-chunked online softmax, recomputation in the backward.

Same contract as splash.py (see ring.py for shapes): the step's normalised output and
logsumexp in the forward, float32 dQ/dK/dV of the step in the backward, with the same
host tables (the mask comes from global positions, kv chunks no query touches are skipped).
Memory per device is O(b * n * L * chunk): K/V are visited one chunk (= block_kv) at a time.

Letters: b batch, t query positions (this shard), s key positions (one chunk), k kv heads,
g query heads per kv head, h head_dim.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from longctx.ops.ring import pick, vary_like

f32 = jnp.float32


def _chunked(x, c):
    """[b, L, ...] -> [L // c, b, c, ...], chunks leading for lax.scan."""
    if x is None:
        return None
    b, L = x.shape[:2]
    return jnp.swapaxes(x.reshape(b, L // c, c, *x.shape[2:]), 0, 1)


def _setup(cfg, q, k, v, ks, d, t):
    tables, c = cfg.tables, cfg.bkv
    b, L, n, h = q.shape
    kvh = k.shape[2]
    q5 = q.reshape(b, L, kvh, n // kvh, h)
    positions = jnp.asarray(tables.q_positions)  # [device, L], S int32 in all
    qpos, kpos = positions[d], positions[pick(tables.kv_source, d, t)]
    xs = (_chunked(k, c), _chunked(v, c), kpos.reshape(-1, c),
          _chunked(ks, c), pick(tables.kv_block_active, d, t))
    return q5, qpos, xs


def _logits(cfg, q5, kc, qpos, kp, qs, ksc):
    """Raw logits [b, k, g, t, s] (float32) and the mask, broadcastable to them."""
    raw = jnp.einsum("btkgh,bskh->bkgts", q5, kc, preferred_element_type=f32)
    mask = cfg.spec.allowed(qpos[:, None], kp[None, :])[None]  # [1, t, s]
    if qs is not None:
        mask = mask & (qs[:, :, None] == ksc[:, None, :])  # [b, t, s]
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


def fwd_step(cfg, q, k, v, qs, ks, d, t):
    b, L, n, h = q.shape
    kvh = k.shape[2]
    q5, qpos, xs = _setup(cfg, q, k, v, ks, d, t)

    def chunk(carry, x):
        kc, vc, kp, ksc, active = x

        def run():
            m, l, o = carry
            raw, mask = _logits(cfg, q5, kc, qpos, kp, qs, ksc)
            s = jnp.where(mask, _cap(cfg, raw), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # row still empty: keep exp() finite
            p = jnp.exp(s - safe[..., None])
            alpha = jnp.exp(m - safe)
            pv = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), vc, preferred_element_type=f32)
            o = o * jnp.moveaxis(alpha, 3, 1)[..., None] + pv
            return m_new, alpha * l + p.sum(-1), o

        return lax.cond(active, run, lambda: carry), None

    init = vary_like((jnp.full((b, kvh, n // kvh, L), -jnp.inf, f32),
                      jnp.zeros((b, kvh, n // kvh, L), f32),
                      jnp.zeros((b, L, kvh, n // kvh, h), f32)), q)
    (m, l, o), _ = lax.scan(chunk, init, xs)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    o = o / jnp.moveaxis(jnp.where(l > 0, l, 1.0), 3, 1)[..., None]
    return o.reshape(b, L, n, h), _to_btn(lse)


def bwd_step(cfg, q, k, v, qs, ks, lse, do, di, d, t):
    b, L, n, h = q.shape
    kvh = k.shape[2]
    q5, qpos, xs = _setup(cfg, q, k, v, ks, d, t)
    do5 = do.reshape(q5.shape)
    lse4, di4 = _to_bkgt(lse, kvh), _to_bkgt(di, kvh)
    c = cfg.bkv

    def chunk(dq, x):
        kc, vc, kp, ksc, active = x

        def run():
            raw, mask = _logits(cfg, q5, kc, qpos, kp, qs, ksc)
            # Recompute the probabilities from the stored global logsumexp.
            p = jnp.where(mask, jnp.exp(_cap(cfg, raw) - lse4[..., None]), 0.0)
            dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(do.dtype), do5, preferred_element_type=f32)
            dp = jnp.einsum("btkgh,bskh->bkgts", do5, vc, preferred_element_type=f32)
            ds = p * (dp - di4[..., None])
            if cfg.soft_cap is not None:  # d cap(x)/dx = 1 - tanh(x / cap)^2
                ds = ds * (1.0 - jnp.square(jnp.tanh(raw / cfg.soft_cap)))
            dq_c = jnp.einsum("bkgts,bskh->btkgh", ds.astype(k.dtype), kc, preferred_element_type=f32)
            dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(q.dtype), q5, preferred_element_type=f32)
            return dq + dq_c, (dk, dv)

        zeros = vary_like(jnp.zeros((b, c, kvh, h), f32), q)
        return lax.cond(active, run, lambda: (dq, (zeros, zeros)))

    dq, (dk, dv) = lax.scan(chunk, vary_like(jnp.zeros(q5.shape, f32), q), xs)
    unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, L, kvh, h)
    return dq.reshape(b, L, n, h), unchunk(dk), unchunk(dv)
