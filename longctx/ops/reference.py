"""Dense attention oracle on whole natural-order sequences (tests only: memory is O(S^2)).

Einsum letters:
  b batch   t query position   s key/value position
  k kv head   g query heads per kv head (GQA group)   h head_dim

It is written independently of `longctx.ops.masks` on purpose (the mask is re-derived here from
positions), so the ring and its block tables are checked against a separate formulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _dense_mask(seq_len, causal, sliding_window, chunk_size):
    i = jnp.arange(seq_len)[:, None]  # query position
    j = jnp.arange(seq_len)[None, :]  # key position
    mask = jnp.ones((seq_len, seq_len), bool)
    if causal:
        mask &= j <= i
    if sliding_window is not None:
        left, right = ((sliding_window, sliding_window) if isinstance(sliding_window, int)
                       else sliding_window)
        left, right = min(left, seq_len), min(right, seq_len)  # (int32 positions: i + right must not wrap)
        mask &= (j >= i - left) & (j <= i + right)
    if chunk_size is not None:
        mask &= (j <= i) & (i // chunk_size == j // chunk_size)
    return mask


def reference_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, softmax_aux=None,
                        *, positions=None, causal=False, sliding_window=None, chunk_size=None,
                        logits_soft_cap=None, softmax_scale=None):
    """softmax(mask(cap(scale * q k^T))) v with an optional per-head sink logit.

    q: [b, S, heads, h]; k, v: [b, S, kv_heads, h]; segment ids [b, S]; softmax_aux [heads].
    With segment ids, a query sees keys of its own document only, and an id <= 0 (padding) sees
    nothing and is seen by nothing. positions [b, S] (in-document): with segment ids and
    chunk_size, chunks are counted from each document's start (i and j in one chunk when
    p_i // chunk == p_j // chunk, in the same document). The sink (gpt-oss style) adds
    exp(aux[head]) to the softmax denominator only; it has no value vector. Rows with nothing to
    attend to (and no sink) give 0. Returns q.dtype.
    """
    b, seq_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    # Compute in at least float32 (float64 if the caller passes it with x64 enabled).
    dt = jnp.promote_types(q.dtype, jnp.float32)
    qf = q.astype(dt).reshape(b, seq_len, kv_heads, groups, head_dim)
    kf, vf = k.astype(dt), v.astype(dt)

    logits = jnp.einsum("btkgh,bskh->bkgts", qf, kf) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)

    documents = q_segment_ids is not None or kv_segment_ids is not None
    per_document_chunks = documents and chunk_size is not None
    mask = _dense_mask(seq_len, causal or per_document_chunks, sliding_window,
                       None if per_document_chunks else chunk_size)[None]  # [1, t, s]
    if documents:
        qs = q_segment_ids if q_segment_ids is not None else kv_segment_ids
        ks = kv_segment_ids if kv_segment_ids is not None else q_segment_ids
        mask = mask & (qs[:, :, None] == ks[:, None, :]) & (qs > 0)[:, :, None] & (ks > 0)[:, None, :]
    if per_document_chunks:
        if positions is None:
            raise ValueError("chunk_size with segment ids needs positions")
        chunk = positions // chunk_size
        mask = mask & (chunk[:, :, None] == chunk[:, None, :])
    mask = mask[:, None, None]  # [b, 1, 1, t, s]
    logits = jnp.where(mask, logits, -jnp.inf)

    # The row max only stabilises exp(); softmax is shift invariant, so no gradient through it.
    m = jnp.max(logits, axis=-1)  # [b, k, g, t]
    if softmax_aux is not None:
        aux = softmax_aux.astype(dt).reshape(1, kv_heads, groups, 1)
        m = jnp.maximum(m, aux)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(logits - m[..., None])  # exactly 0 where masked
    denom = p.sum(-1)
    if softmax_aux is not None:
        denom = denom + jnp.exp(aux - m)
    out = jnp.einsum("bkgts,bskh->btkgh", p, vf)
    denom = jnp.where(denom == 0, 1.0, denom)  # fully masked rows: p == 0 -> out == 0
    out = out / jnp.moveaxis(denom, -1, 1)[..., None]
    return out.reshape(b, seq_len, heads, head_dim).astype(q.dtype)
