"""All-gather context parallelism: every device gathers all of K/V once per layer and attends its
own query shard to them (Llama 3's long-context recipe; MaxText's default).

With grouped-query attention K/V are small next to Q (Llama-3-8B: 8 KV heads for 32 query heads),
so gathering them costs less than the ring's sp - 1 passes of the same bytes, and the gather is
one collective that XLA can run under compute instead of sp - 1 dependent ones. The price is
memory: each device holds the whole sequence's K/V for one layer at a time (and, in the
backward, their float32 gradients until the reduce-scatter).

Forward: the local K/V shard's pairs first (ops/shard_pairs.py), which need no communication, so
that a scheduler may run the gather of the other shards under them (as PyTorch's all-gather CP
does; libtpu 0.10.2 does not: it emits a synchronous all-gather after the local pass, see
docs/attention.md); then the gathered shards. Backward: K/V gathered again (a layer keeps only its own shards between
forward and backward, as the ring does), dK and dV of every shard accumulated in float32 on
each device and reduce-scattered to their owners. The gather takes every shard: what a window
or chunk needs of them is decided per pair by the tables (pairs no block of which the mask keeps
are neither computed nor read), not by gathering less, which would need a collective per shape
of the mask. The data layout decides the balance, as for the ring (contiguous / zigzag /
striped / auto: the same tables).

Schedule: a device computes all its pairs after one gather, so no step waits for another device.
Price: the gather of every other shard's K, V (and ids), again in the backward, and the
reduce-scatter of dK, dV (float32); neither hides behind the blocks: the TPU compiler runs them
before and after the kernel (docs/attention.md). Working memory: the whole sequence's K, V and
their float32 gradients twice, the kernel's output and the reduce-scatter's operand alive
together (the 8B step at 2,097,152 tokens over 64 chips compiles to 92.4 GiB,
docs/fit_strategies.md; one float32 copy would say 69).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from longctx.ops import ring, shard_pairs, strategy, strategy_schedule


def _travelling(cfg, x):
    """A [b, L, ...] K/V shard stacked [1, ...] in the backend's travelling layout."""
    return jax.vmap(ring.step_backend(cfg).to_kv_layout)(x[None])


def _gathered(cfg, k, v, ks):
    """Every shard's K, V (travelling layout) and K/V segment ids, stacked [sp, ...] in shard
    order."""
    gather = lambda x: jax.tree.map(lambda leaf: lax.all_gather(leaf, cfg.axis_name), x)  # noqa: E731
    return gather(_travelling(cfg, k)[0]), gather(_travelling(cfg, v)[0]), gather(ks)


def forward(cfg, q, k, v, qs, ks, aux):
    """(out [b, L, n, h] in q's dtype, lse [b, L, n] float32) of this device's query shard."""
    d = lax.axis_index(cfg.axis_name)
    shards = jnp.arange(cfg.sp, dtype=jnp.int32)
    qx = ring.scaled_query(cfg, q)[None]
    qs1 = jax.tree.map(lambda x: x[None], qs)
    kv_heads = k.shape[2]
    acc = shard_pairs.forward_start(cfg, qx, qs1, kv_heads)
    local = (_travelling(cfg, k), _travelling(cfg, v), jax.tree.map(lambda x: x[None], ks))
    acc = shard_pairs.forward(cfg, acc, qx, qs1, d[None], local, d[None], kv_heads)
    acc = shard_pairs.forward(cfg, acc, qx, qs1, d[None], _gathered(cfg, k, v, ks), shards,
                              kv_heads, skip_kv_shard=d)
    o, lse = shard_pairs.forward_end(cfg, acc)
    o, lse = ring.add_sinks(o[0], lse[0], aux)
    return o.astype(q.dtype), lse


def backward(cfg, res, do):
    """(dq, dk, dv, None, None, d_aux): the gradients of this device's shards."""
    q, k, v, qs, ks, aux, out, lse = res
    backend = ring.step_backend(cfg)
    d = lax.axis_index(cfg.axis_name)
    shards = jnp.arange(cfg.sp, dtype=jnp.int32)
    do, di, lse_k = ring.backward_inputs(q, out, lse, do)
    qx = ring.scaled_query(cfg, q)
    stack = lambda x: jax.tree.map(lambda leaf: leaf[None], x)  # noqa: E731
    kv = _gathered(cfg, k, v, ks)
    acc = shard_pairs.backward_start(cfg, qx[None], stack(qs), lse_k[None], do[None], di[None],
                                     k.shape[2], kv[0].shape)
    dq, dk, dv = shard_pairs.backward(cfg, acc, qx[None], stack(qs), lse_k[None], do[None],
                                      di[None], d[None], kv, shards, k.shape[2])
    # Each device holds a share of every shard's dK, dV: summed over devices, shard c to device c.
    dk, dv = (backend.from_kv_layout(lax.psum_scatter(x, cfg.axis_name)) for x in (dk, dv))
    dq = (shard_pairs.backward_end(cfg, dq)[0] * cfg.scale).astype(q.dtype)
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            ring.sink_gradient(aux, lse_k, di))


class AllGather(strategy.AnyHeads, strategy.Strategy):
    name = "all_gather"
    simplicity = 1

    forward = staticmethod(forward)
    backward = staticmethod(backward)

    def from_step_blocks(self, per_step, ring_critical_path, kept, ring_steps, static_pairs):
        return strategy_schedule.all_pairs_at_once(self, per_step, kept)

    def dead_grid_steps(self, live):
        # one call over the gathered sequence: every row's kv blocks of all shards; the dK/dV
        # grid's columns are the sequence's kv blocks, each with the device's live q blocks
        sp, nq = live.shape[0], live.shape[2]
        rows, cols = live.sum(axis=3), live.sum(axis=2)
        work = rows.sum(axis=(1, 2))
        return (float(nq * rows.sum(axis=1).max() - work.max()),
                float(sp * nq * cols.max() - work.max()))

    def steps_in_words(self, cfg):
        return "one gather"

    def transfers(self, shape, cfg, steps=None):
        sp = shape.sp
        gather = strategy.Transfer("all_gather", (sp - 1) * (2 * shape.kv_bytes + shape.ids_bytes),
                                   1, sp, under_blocks=False)
        scatter = strategy.Transfer("reduce_scatter", (sp - 1) * 2 * shape.kv32_bytes, 1, sp,
                                    under_blocks=False)
        return {"forward": (gather,), "backward": (gather, scatter)}

    def kernel_calls(self, cfg, travelled):
        return 1.0

    def working_bytes(self, shape, cfg):
        return shape.sp * 2 * (shape.kv_bytes + 2 * shape.kv32_bytes)
