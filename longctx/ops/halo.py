"""Halo exchange: each device receives, from each other shard, only the K/V its queries can reach.

A sliding window w much shorter than a shard needs of the shard before it only its last w tokens
(in zigzag, of each of its two chunks, from both neighbours), and a chunked mask whose chunks lie
inside shards needs nothing at all. The ring sends whole shards; this strategy works out on the
host, from the ring's own block tables (tables.block_classes), which blocks of shard
(d - s) mod sp any device d's queries keep at every ring offset s, and sends, in one
`lax.ppermute` per offset that has any, only the hull of those blocks (a contiguous run of
blocks, the same on every device, to the devices that need it). The receiver places it where
it lies in its shard, in an otherwise empty shard-sized buffer, and computes the pair (own
query shard, that K/V shard) with the same tables and per-step backends as every strategy
(ops/shard_pairs.py): the blocks outside the hull are empty in the static mask, so they are
never read. Documents prune the compute, not the bytes (those are static).

Backward: the halos are received again (a layer keeps only its own shards, as the ring does),
each pair's dK and dV are computed in float32, and the hull of each goes back to its owner by
the reverse permutation, to be added to the owner's own.

Exact for every mask and layout. It pays where a mask reaches few blocks of other shards: windows
and chunks in the contiguous and zigzag layouts (Gemma 3's window 1,024 at 131,072 tokens over
sp = 16 sends 2 of 16 blocks of 512, where the ring sends a whole shard). Striped spreads every
window over every device, so there the hulls are whole shards: the same bytes as all-gather, in
sp - 1 permutes, and the same memory. `plan` and `tokens_sent` say what is sent.

As a strategy (`Halo`): a device computes all-gather's pairs, each after its own permute of the
blocks it needs. Price: one permute per exchange of its hull (K, V, ids; in the backward again,
and the hull's dK, dV home), exposed: every kernel call waits for every hull, and the dK, dV
hulls wait for every call. Working memory: the 1 + E shard-sized K/V buffers it stacks (E
exchanges) and float32 dK, dV for each.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx.ops import ring, shard_pairs, strategy, strategy_schedule
from longctx.ops import tables as tables_lib


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What one ring offset sends: tokens [start, stop) of every shard (a hull of whole blocks),
    from device (a - offset) mod sp to each device a in the permutation's receivers."""

    offset: int
    start: int
    stop: int
    perm: tuple[tuple[int, int], ...]  # (source, receiver) pairs, for lax.ppermute


@functools.lru_cache(maxsize=64)
def plan(spec, layout: str, seq_len: int, sp: int, bq: int, bkv: int) -> tuple[Exchange, ...]:
    """The exchanges of one mask (offsets 1..sp-1 that any device needs), on the host."""
    classes = tables_lib.block_classes(spec, layout, seq_len, sp, bq, bkv)  # [device, step, qb, kb]
    exchanges = []
    for offset in range(1, sp):
        kept = classes[:, offset] != 0  # device a at ring step `offset` holds shard a - offset
        receivers = np.flatnonzero(kept.any(axis=(1, 2)))
        if receivers.size == 0:
            continue
        blocks = np.flatnonzero(kept.any(axis=(0, 1)))
        perm = tuple((int((a - offset) % sp), int(a)) for a in receivers)
        exchanges.append(Exchange(offset, int(blocks[0]) * bkv, (int(blocks[-1]) + 1) * bkv, perm))
    return tuple(exchanges)


def exchanges(cfg) -> tuple[Exchange, ...]:
    return plan(cfg.spec, cfg.layout, cfg.seq_len, cfg.sp, cfg.bq, cfg.bkv)


def tokens_sent(cfg) -> int:
    """K/V tokens a layer's forward sends, summed over its permutes (each counted for its busiest
    device, as plan/collectives.py counts a program's): the hulls' lengths."""
    return sum(ex.stop - ex.start for ex in exchanges(cfg))


def _received(cfg, ex: Exchange, k, v, ks):
    """This device's (K, V, K/V segment ids) of shard (d - offset) mod sp: the hull as received,
    the rest of the shard empty (zero K/V, padding ids: never read, since the static mask keeps
    no block there), K and V in the backend's travelling layout."""
    shard_len = k.shape[1]

    def send(x, fill):
        part = lax.ppermute(lax.slice_in_dim(x, ex.start, ex.stop, axis=1), cfg.axis_name, ex.perm)
        pad = [(0, 0)] * x.ndim
        pad[1] = (ex.start, shard_len - ex.stop)
        return jnp.pad(part, pad, constant_values=fill)

    backend = ring.step_backend(cfg)
    # ids padded as padding; a per-row layout's positions (tables.RowTokens) with anything; no
    # ids, nothing (the fills take the structure of `ks`)
    fills = (tables_lib.RowTokens(ring.PAD_KV, 0) if isinstance(ks, tables_lib.RowTokens) else
             None if ks is None else ring.PAD_KV)
    return (backend.to_kv_layout(send(k, 0)), backend.to_kv_layout(send(v, 0)),
            jax.tree.map(send, ks, fills))


def _held_shards(cfg, k, v, ks):
    """(K, V, K/V segment ids) of every shard this device attends to, stacked [1 + exchanges, ...]
    as shard_pairs takes them: its own first, then each exchange's halo; and their global indices
    [1 + exchanges]. One stack, so that one kernel call in shard_pairs' loop computes every pair:
    a call per pair would put that many copies of the kernel in the layer's program (a
    hybrid's compile time grows with them)."""
    backend = ring.step_backend(cfg)
    d = lax.axis_index(cfg.axis_name)
    held = [(backend.to_kv_layout(k), backend.to_kv_layout(v), ks)]
    held += [_received(cfg, ex, k, v, ks) for ex in exchanges(cfg)]
    k_all, v_all = (jnp.stack([h[i] for h in held]) for i in (0, 1))
    ks_all = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[h[2] for h in held])
    shards = jnp.stack([d] + [(d - ex.offset) % cfg.sp for ex in exchanges(cfg)])
    return (k_all, v_all, ks_all), shards


def forward(cfg, q, k, v, qs, ks, aux):
    """(out [b, L, n, h] in q's dtype, lse [b, L, n] float32) of this device's query shard."""
    d = lax.axis_index(cfg.axis_name)
    qx = ring.scaled_query(cfg, q)[None]
    qs1 = jax.tree.map(lambda x: x[None], qs)
    kv_heads = k.shape[2]
    acc = shard_pairs.forward_start(cfg, qx, qs1, kv_heads)
    held, shards = _held_shards(cfg, k, v, ks)
    acc = shard_pairs.forward(cfg, acc, qx, qs1, d[None], held, shards, kv_heads)
    o, lse = shard_pairs.forward_end(cfg, acc)
    o, lse = ring.add_sinks(o[0], lse[0], aux)
    return o.astype(q.dtype), lse


def _add_returned(cfg, ex: Exchange, total, part):
    """`total` (this device's dK or dV, float32 [b, L, k, h]) plus the hull of `part` (the dK or
    dV this device's queries gave the halo it received, in the travelling layout) that the
    receivers of its own halo send back: each device gets what its halo earned."""
    hull = lax.slice_in_dim(ring.step_backend(cfg).from_kv_layout(part), ex.start, ex.stop, axis=1)
    home = tuple((receiver, source) for source, receiver in ex.perm)
    return total.at[:, ex.start:ex.stop].add(lax.ppermute(hull, cfg.axis_name, home))


def backward(cfg, res, do):
    """(dq, dk, dv, None, None, d_aux): the gradients of this device's shards."""
    q, k, v, qs, ks, aux, out, lse = res
    backend = ring.step_backend(cfg)
    d = lax.axis_index(cfg.axis_name)
    do, di, lse_k = ring.backward_inputs(q, out, lse, do)
    qx = ring.scaled_query(cfg, q)[None]
    q_side = (qx, jax.tree.map(lambda x: x[None], qs), lse_k[None], do[None], di[None])
    held, shards = _held_shards(cfg, k, v, ks)
    acc = shard_pairs.backward_start(cfg, *q_side, k.shape[2], held[0].shape)
    dq, dk_held, dv_held = shard_pairs.backward(cfg, acc, *q_side, d[None], held, shards, k.shape[2])
    dk, dv = backend.from_kv_layout(dk_held[0]), backend.from_kv_layout(dv_held[0])
    for i, ex in enumerate(exchanges(cfg), start=1):
        dk, dv = _add_returned(cfg, ex, dk, dk_held[i]), _add_returned(cfg, ex, dv, dv_held[i])
    dq = (shard_pairs.backward_end(cfg, dq)[0] * cfg.scale).astype(q.dtype)
    return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            ring.sink_gradient(aux, lse_k, di))


class Halo(strategy.AnyHeads, strategy.Strategy):
    name = "halo"
    simplicity = 2
    local_masks_only = True

    forward = staticmethod(forward)
    backward = staticmethod(backward)

    def from_step_blocks(self, per_step, ring_critical_path, kept, ring_steps, static_pairs):
        # the same pairs as all-gather's, each after its own permute of the blocks it needs
        return strategy_schedule.all_pairs_at_once(self, per_step, kept)

    def dead_grid_steps(self, live):
        return 0.0, 0.0  # per exchange, each call's tables its own: not counted

    def steps_in_words(self, cfg):
        return f"halo offsets {[ex.offset for ex in exchanges(cfg)]}"

    def transfers(self, shape, cfg, steps=None):
        # One permute per exchange, of its hull: K, V and ids (again in the backward), and in the
        # backward the hull's dK, dV (float32) back to their owners. None runs under the blocks:
        # the one loop of kernel calls starts once every hull is stacked, and the dK, dV hulls go
        # home after it (`_held_shards`, `backward`).
        sent = exchanges(cfg)
        tokens = sum(ex.stop - ex.start for ex in sent)
        L = shape.shard_len
        per_token, per_token32 = (2 * shape.kv_bytes + shape.ids_bytes) // L, 2 * shape.kv32_bytes // L

        def permute(nbytes):
            return (strategy.Transfer("permute", nbytes, len(sent), 2, under_blocks=False),)

        return {"forward": permute(tokens * per_token),
                "backward": permute(tokens * (per_token + per_token32))}

    def kernel_calls(self, cfg, travelled):
        return 1.0 + len(exchanges(cfg))

    def working_bytes(self, shape, cfg):
        # K, V of the 1 + E shards it holds (its own, and each exchange's hull placed in a
        # shard-sized buffer), and their float32 dK, dV twice: the backward loop's zeros and its
        # result are alive together (the compiled program's largest buffers). With E = sp - 1
        # (striped, or a global mask) that is all-gather's whole sequence.
        held = 1 + len(exchanges(cfg))
        return held * 2 * (shape.kv_bytes + 2 * shape.kv32_bytes)
