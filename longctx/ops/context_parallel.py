"""Attention over a sequence split across the `sp` mesh axis, by one of five strategies.

  ring        K/V pass around the sp devices, one hop per step (ring.py, ring_strategy.py; the
              default)
  all_gather  K/V gathered on every device once per layer, dK/dV reduce-scattered (all_gather.py)
  ulysses     all-to-all from sequence shards to head shards and back (ulysses.py)
  usp         Ulysses inside groups of `ulysses_degree` neighbouring devices, the ring across
              the groups (usp.py, ulysses.py)
  halo        each device receives from each shard only the blocks its queries' mask reaches,
              one permute per ring offset that has any (halo.py): windows and chunks pass a
              halo, not whole shards

Every strategy takes the same arguments as `ring_attention` (masks, documents, sinks, soft cap,
layout, impl, blocks), computes the same function with the same per-step backends and tables,
and skips the same blocks that no document needs (ops/shard_pairs.py). Which one is fastest
depends on the shape, the heads, the documents and the topology (docs/attention.md). Each is an
object (ops/strategy.py: what it runs, its schedule, its price), named in REGISTRY below.
"""
from __future__ import annotations

import functools

from longctx.ops import all_gather, halo, ring, ring_strategy, strategy, ulysses, usp
from longctx.ops.shmap import sum_over_devices

# Every strategy, one line each, in the order the planner enumerates them; the first is the
# default (configs older than attention.cp ran it). A new strategy is a module with a
# strategy.Strategy subclass and a line here.
REGISTRY = {cls.name: cls for cls in (
    ring_strategy.Ring,
    all_gather.AllGather,
    ulysses.Ulysses,
    usp.UlyssesRing,
    halo.Halo,
)}
STRATEGIES = tuple(REGISTRY)
DEFAULT = STRATEGIES[0]


def _complete(cls) -> None:
    """The class attributes with no default are set (abc checks the methods when one is made)."""
    missing = [a for a in ("name", "simplicity") if not hasattr(cls, a)]
    if missing:
        raise TypeError(f"strategy {cls.__name__} does not set {', '.join(missing)}")


for _cls in REGISTRY.values():
    _complete(_cls)


def named(name: str, degree: int | None = None) -> strategy.Strategy:
    """The strategy `name` (one of STRATEGIES) with its Ulysses degree where it takes one."""
    if name not in REGISTRY:
        raise ValueError(f"strategy={name!r} is not one of {STRATEGIES}")
    cls = REGISTRY[name]
    if cls.takes_degree:
        if degree is None:
            raise ValueError(f"strategy={name!r} needs ulysses_degree (the Ulysses group size, "
                             "dividing sp)")
        return cls(int(degree))
    if degree is not None:
        takers = [n for n, c in REGISTRY.items() if c.takes_degree]
        raise ValueError(f"ulysses_degree={degree} is only for "
                         f"{' or '.join(f'strategy={n!r}' for n in takers)}, not {name!r}")
    return cls()


def candidates(heads: int, sp: int) -> list[strategy.Strategy]:
    """Every strategy that can split `heads` query heads over `sp` devices, in REGISTRY order."""
    return [s for cls in REGISTRY.values() for s in cls.candidates(heads, sp)]


@functools.lru_cache(maxsize=None)
def attention_fn(cfg: ring.RingConfig, chosen: strategy.Strategy):
    """The differentiable attention of one strategy for one static configuration."""
    return ring.differentiable(cfg, chosen.forward, chosen.backward)


def _prepare(query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, name, ulysses_degree,
             kwargs):
    chosen = named(name, ulysses_degree)
    cfg, q_ids, kv_ids, aux = ring.prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                           softmax_aux, **kwargs)
    chosen.check(query.shape[2], cfg.sp)
    return cfg, chosen, q_ids, kv_ids, aux


def context_parallel_attention(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                               softmax_aux=None, *, strategy=DEFAULT, ulysses_degree=None, **kwargs):
    """`ring_attention` (the same arguments and result: call inside `jax.shard_map` on this
    device's shard) computed by `strategy`, one of STRATEGIES; `ulysses_degree` U for 'usp'
    (dividing sp and the query heads). 'ulysses' needs the query heads divisible by sp."""
    cfg, chosen, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    return attention_fn(cfg, chosen)(query, key, value, q_ids, kv_ids, aux)


def context_parallel_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                             softmax_aux=None, *, strategy=DEFAULT, ulysses_degree=None, **kwargs):
    """The forward alone, (out, lse [b, L, heads] float32), as `ring_attention_forward`."""
    cfg, chosen, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    return chosen.forward(cfg, query, key, value, q_ids, kv_ids, aux)


def context_parallel_backward(query, key, value, out, lse, d_out, q_segment_ids=None,
                              kv_segment_ids=None, softmax_aux=None, *, strategy=DEFAULT,
                              ulysses_degree=None, **kwargs):
    """(d_query, d_key, d_value, d_aux) from the forward's (out, lse), as
    `ring_attention_backward`; d_aux summed over every device."""
    cfg, chosen, q_ids, kv_ids, aux = _prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                               softmax_aux, strategy, ulysses_degree, kwargs)
    res = (query, key, value, q_ids, kv_ids, aux, out, lse)
    dq, dk, dv, _, _, daux = chosen.backward(cfg, res, d_out)
    return dq, dk, dv, None if daux is None else sum_over_devices(daux)
