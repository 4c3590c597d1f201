"""Attention over a sequence split across the `sp` mesh axis, by one of five strategies.

  ring        K/V pass around the sp devices, one hop per step (ring.py; the default)
  all_gather  K/V gathered on every device once per layer, dK/dV reduce-scattered (all_gather.py)
  ulysses     all-to-all from sequence shards to head shards and back (ulysses.py)
  usp         Ulysses inside groups of `ulysses_degree` neighbouring devices, the ring across
              the groups (ulysses.py)
  halo        each device receives from each shard only the blocks its queries' mask reaches,
              one permute per ring offset that has any (halo.py): windows and chunks pass a
              halo, not whole shards

Every strategy takes the same arguments as `ring_attention` (masks, documents, sinks, soft cap,
layout, impl, blocks), computes the same function with the same per-step backends and tables,
and skips the same blocks that no document needs (ops/shard_pairs.py). Which one is fastest
depends on the shape, the heads, the documents and the topology (docs/attention.md).
"""
from __future__ import annotations

import functools

from longctx.ops import all_gather, halo, ring, ulysses
from longctx.ops.shmap import sum_over_devices

STRATEGIES = ("ring", "all_gather", "ulysses", "usp", "halo")


def _degree(strategy: str, ulysses_degree, sp: int, heads: int) -> int:
    """The Ulysses degree of a strategy (1 where it has none), checked against sp and the heads."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "usp":
        if ulysses_degree is None:
            raise ValueError("strategy='usp' needs ulysses_degree (the Ulysses group size, dividing sp)")
        degree = int(ulysses_degree)
    elif ulysses_degree is not None:
        raise ValueError(f"ulysses_degree={ulysses_degree} is only for strategy='usp', not {strategy!r}")
    else:
        degree = sp if strategy == "ulysses" else 1
    if strategy in ("ulysses", "usp"):
        ulysses.check_heads(heads, degree, sp)
    return degree


def _steps(strategy: str, degree: int):
    """(forward(cfg, q, k, v, qs, ks, aux) -> (out, lse), backward(cfg, res, do) -> grads)."""
    if strategy == "ring":
        return ring.forward, ring.backward
    if strategy == "all_gather":
        return all_gather.forward, all_gather.backward
    if strategy == "halo":
        return halo.forward, halo.backward
    return functools.partial(ulysses.forward, degree=degree), functools.partial(ulysses.backward, degree=degree)


@functools.lru_cache(maxsize=None)
def attention_fn(cfg: ring.RingConfig, strategy: str, degree: int):
    """The differentiable attention of one strategy for one static configuration."""
    if strategy == "ring":
        return ring.ring_fn(cfg)
    return ring.differentiable(cfg, *_steps(strategy, degree))


def _prepare(query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, strategy,
             ulysses_degree, kwargs):
    cfg, q_ids, kv_ids, aux = ring.prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                           softmax_aux, **kwargs)
    degree = _degree(strategy, ulysses_degree, cfg.sp, query.shape[2])
    return cfg, degree, q_ids, kv_ids, aux


def context_parallel_attention(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                               softmax_aux=None, *, strategy="ring", ulysses_degree=None, **kwargs):
    """`ring_attention` (the same arguments and result: call inside `jax.shard_map` on this
    device's shard) computed by `strategy`, one of STRATEGIES; `ulysses_degree` U for 'usp'
    (dividing sp and the query heads). 'ulysses' needs the query heads divisible by sp."""
    cfg, degree, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    return attention_fn(cfg, strategy, degree)(query, key, value, q_ids, kv_ids, aux)


def context_parallel_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                             softmax_aux=None, *, strategy="ring", ulysses_degree=None, **kwargs):
    """The forward alone, (out, lse [b, L, heads] float32), as `ring_attention_forward`."""
    cfg, degree, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    return _steps(strategy, degree)[0](cfg, query, key, value, q_ids, kv_ids, aux)


def context_parallel_backward(query, key, value, out, lse, d_out, q_segment_ids=None,
                              kv_segment_ids=None, softmax_aux=None, *, strategy="ring",
                              ulysses_degree=None, **kwargs):
    """(d_query, d_key, d_value, d_aux) from the forward's (out, lse), as
    `ring_attention_backward`; d_aux summed over every device."""
    cfg, degree, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    res = (query, key, value, q_ids, kv_ids, aux, out, lse)
    dq, dk, dv, _, _, daux = _steps(strategy, degree)[1](cfg, res, d_out)
    return dq, dk, dv, None if daux is None else sum_over_devices(daux)
