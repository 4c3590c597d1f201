"""Attention of the query shards a device holds against the K/V shards it holds: the ring's steps
without the ring, for the strategies that bring several shards to one device.

Every context-parallel strategy splits the sequence into the same sp shards (in the data's
layout) and computes the same thing: each query shard a against each K/V shard c. One such
(query shard, K/V shard) pair is exactly what a ring step computes on device a when the K/V of
c visit it, so its blocks are the ring's (`tables.step_blocks(a, c)`: the mask, the layout and
the two shard indices decide them), and the per-step backends (splash.py, xla.py) compute it
with the same block skipping and the same document pruning per batch row. What differs between
strategies is only which pairs a device holds and how the shards got there:

  ring        one query shard, the K/V shards arriving one per step (ring.py, not this module)
  all_gather  one query shard, every K/V shard at once (all_gather.py)
  ulysses     every query shard and every K/V shard, for a slice of the heads (ulysses.py)
  usp         the U query shards of a Ulysses group, the U K/V shards of a group, visiting
              around a ring of groups (ulysses.py)

A pair that no block of the static mask keeps is never computed (a host table, `pair_active`,
read on device); one whose blocks the documents leave empty is skipped at run time (`lax.cond`
in the backend, as a ring step is).

Shapes (L = S / sp, U query shards and M K/V shards held, stacked on a leading axis):
  q [U, b, L, n, h] (scaled, as the kernels take it)   query segment ids [U, b, L] | None
  k, v: [M, ...] in the backend's travelling layout     K/V segment ids [M, b, L] | None
  (in a per-row layout the ids are tables.RowTokens, ids and positions each [U or M, b, L])
  the shards' global indices: int32 [U] and [M] (traced)
The forward's accumulators and the backward's dQ are the backend's own, one per query shard,
stacked [U, ...]; dK, dV float32 in the travelling layout, stacked [M, ...].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx.ops import block_source, ring
from longctx.ops import tables as tables_lib
from longctx.ops.shmap import vary_like


def by_pair(per_step: np.ndarray) -> np.ndarray:
    """[device a, ring step s] -> [query shard a, K/V shard (a - s) mod sp]: what device a holds at
    step s (the ring's ppermute sends device j's K/V to j + 1), indexed by the K/V shard instead.
    The one such transform on the host (tests/ops/test_strategy_schedule.py checks it against the
    ring's own permutation)."""
    sp = per_step.shape[0]
    a = np.arange(sp)[:, None]
    pairs = np.zeros_like(per_step)
    pairs[a, (a - np.arange(sp)[None, :]) % sp] = per_step
    return pairs


@functools.lru_cache(maxsize=32)
def static_pairs(spec, layout, seq_len, sp, bq, bkv) -> np.ndarray:
    """bool [query shard, K/V shard]: whether the static mask keeps any block of the pair."""
    classes = tables_lib.block_classes(spec, layout, seq_len, sp, bq, bkv)  # [d, step, qb, kb]
    active = by_pair(classes.any(axis=(2, 3)))
    active.setflags(write=False)
    return active


def pair_active(cfg) -> np.ndarray:
    """bool [query shard, K/V shard]: whether the static mask keeps any block of the pair."""
    return static_pairs(cfg.spec, cfg.layout, cfg.seq_len, cfg.sp, cfg.bq, cfg.bkv)


def _index(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _set(tree, i, part):
    return jax.tree.map(lambda x, p: x.at[i].set(p), tree, part)


def _stacked(tree, count: int):
    """`count` copies of a tree of constants (the backends' zero accumulators), stacked."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), tree)


def _pair(cfg, a, c, q_side, qs, ks, documents: bool, skip=None):
    """(blocks, live, run) of query shard a against K/V shard c (traced ints)."""
    blocks, live = block_source.of(cfg).pair(a, c, q_side, qs, ks)
    # Without documents the host table says whether the pair has work (a predicate that
    # depends on the data costs XLA memory, ring._any_live); with them, the live blocks do.
    run = jnp.any(live) if documents else jnp.asarray(pair_active(cfg))[a, c]
    if skip is not None:
        run = run & (c != skip)
    return blocks, live, run


def forward_start(cfg, q, qs, kv_heads):
    """The forward's accumulators, one per query shard, stacked [U, ...]."""
    _, acc = ring.step_backend(cfg).fwd_start(cfg, q[0], _index(qs, 0), kv_heads)
    return _stacked(acc, q.shape[0])


def forward(cfg, acc, q, qs, q_shards, kv, kv_shards, kv_heads, *, skip_kv_shard=None):
    """The accumulators after every pair (q_shards[u], kv_shards[m]) the mask keeps.
    kv = (k, v, ks) stacked [M, ...]; kv_heads: the K/V heads held; skip_kv_shard (traced int): a K/V shard whose pairs were
    already computed (all_gather's local shard, computed before its gather)."""
    backend = ring.step_backend(cfg)
    k, v, ks = kv
    documents = block_source.of(cfg).data_dependent(qs)

    def one_query_shard(u, acc):
        qs_u = _index(qs, u)
        ctx, _ = backend.fwd_start(cfg, q[u], qs_u, kv_heads)
        q_side = block_source.of(cfg).query_side(qs_u)

        def one_kv_shard(m, acc_u):
            ks_m = _index(ks, m)
            blocks, live, run = _pair(cfg, q_shards[u], kv_shards[m], q_side, qs_u, ks_m,
                                      documents, skip_kv_shard)
            return backend.fwd_step(cfg, ctx, acc_u, k[m], v[m], ks_m, blocks, live, run)

        return _set(acc, u, lax.fori_loop(0, k.shape[0], one_kv_shard, _index(acc, u)))

    return lax.fori_loop(0, q.shape[0], one_query_shard, acc)


def forward_end(cfg, acc):
    """(out float32 [U, b, L, n, h], lse [U, b, L, n]) from the stacked accumulators (the
    backends' fwd_end reads only the accumulator)."""
    backend = ring.step_backend(cfg)
    return jax.vmap(lambda one: backend.fwd_end(cfg, None, one))(acc)


def backward_start(cfg, q, qs, lse, do, di, kv_heads, kv_shape):
    """(dQ accumulators [U, ...], dK and dV zeros float32 [M, ...] in the travelling layout)."""
    _, dq = ring.step_backend(cfg).bwd_start(cfg, q[0], _index(qs, 0), lse[0],
                                             do[0], di[0], kv_heads)
    zeros = vary_like(jnp.zeros(kv_shape, jnp.float32), dq)
    return _stacked(dq, q.shape[0]), zeros, zeros


def backward(cfg, acc, q, qs, lse, do, di, q_shards, kv, kv_shards, kv_heads):
    """(dQ, dK, dV) accumulators after every pair the mask keeps; acc from backward_start (or a
    previous call), q-side inputs stacked [U, ...] in the ring's layout ([b, L, n(, h)])."""
    backend = ring.step_backend(cfg)
    k, v, ks = kv
    documents = block_source.of(cfg).data_dependent(qs)

    def one_query_shard(u, acc):
        dq, dk, dv = acc
        qs_u = _index(qs, u)
        ctx, _ = backend.bwd_start(cfg, q[u], qs_u, lse[u], do[u], di[u], kv_heads)
        q_side = block_source.of(cfg).query_side(qs_u)

        def one_kv_shard(m, carry):
            dq_u, dk, dv = carry
            ks_m = _index(ks, m)
            blocks, live, run = _pair(cfg, q_shards[u], kv_shards[m], q_side, qs_u, ks_m,
                                      documents)
            dq_u, dk_m, dv_m = backend.bwd_step(cfg, ctx, (dq_u, dk[m], dv[m]), k[m], v[m], ks_m,
                                                blocks, live, run)
            return dq_u, dk.at[m].set(dk_m), dv.at[m].set(dv_m)

        dq_u, dk, dv = lax.fori_loop(0, k.shape[0], one_kv_shard, (_index(dq, u), dk, dv))
        return _set(dq, u, dq_u), dk, dv

    return lax.fori_loop(0, q.shape[0], one_query_shard, acc)


def backward_end(cfg, dq):
    """dQ float32 [U, b, L, n, h] from the stacked accumulators."""
    backend = ring.step_backend(cfg)
    return jax.vmap(lambda one: backend.bwd_end(cfg, None, one))(dq)
