"""Ulysses context parallelism, alone and inside a ring of groups (usp: Ulysses x ring).

Ulysses (DeepSpeed-Ulysses): an all-to-all turns each device's sequence shard of every head
into every sequence shard of a slice of the heads; each device attends its heads over the
whole sequence with no communication; a second all-to-all turns the output back. Its
collectives move each device's Q, K, V and output once, whatever the mask, in two steps; the
ring moves K/V sp - 1 times. It needs the query heads divisible by the Ulysses degree U.

usp (Ulysses x ring, "unified sequence parallelism"): the sp devices form sp / U groups of U
neighbours (consecutive indices of the sp axis, which on TPU are consecutive chips of
mesh.ring_cycle, one ICI link apart: each group's all-to-all stays among U adjacent chips);
Ulysses runs inside each group, over the group's U shards, and the groups pass their K/V
around a ring of groups, as the ring passes shards. U = sp is Ulysses; every U between trades
the heads' divisibility and the all-to-all's reach against ring passes. A pass of the ring of
groups goes from device j to j + U: U links along the ring cycle, and with every device sending
at once each link carries U devices' K/V (the ring's passes: one link, one device's K/V);
a device order that made the groups' ring one hop (groups stacked along a second torus axis) is
not built.

A device therefore holds, for n / U of the heads, the U query shards of its group and, at each
ring step, the U K/V shards of one group: it computes their U x U (query shard, K/V shard)
pairs (ops/shard_pairs.py), each with the ring's tables, so every mask, the layout's positions
and the documents' block skipping are the ring's, unchanged. The data layout needs no balance
for Ulysses (each device computes every query shard, for its heads: the same work on every
device whatever the layout; contiguous is the natural one); for usp the ring of groups has the
ring's balance question at the granularity of groups, and the layout answers it as for the ring.

K/V heads: each device needs the K/V heads its query heads read (`kv_head_slots`). With the KV
heads divisible by U each device gets its own share; with fewer KV heads than U (8 KV heads and
U = 16, or MQA) each KV head is sent to every device whose query heads read it, and their dK/dV
contributions are summed back on the owner: no error, and no device computes another's heads.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx.ops import ring, shard_pairs


@functools.lru_cache(maxsize=64)
def kv_head_slots(heads: int, kv_heads: int, degree: int) -> np.ndarray:
    """int [degree, slots]: the K/V head each of device r's K/V slots holds, r in range(U).

    Device r holds query heads r * n/U .. (r + 1) * n/U - 1; query head i reads K/V head
    i // (n / kv_heads). The slots are laid out so that the backends' grouping (local query head
    j reads local K/V slot j // (n/U / slots)) gives every local head its own K/V head."""
    local, group = heads // degree, heads // kv_heads
    if local % group == 0:    # whole groups per device: KV heads divisible by U
        slots = local // group
        table = [[r * slots + j for j in range(slots)] for r in range(degree)]
    elif group % local == 0:  # one K/V head per device, shared by the devices of its group
        table = [[r * local // group] for r in range(degree)]
    else:                     # groups straddle devices: one slot per local query head
        table = [[(r * local + i) // group for i in range(local)] for r in range(degree)]
    out = np.asarray(table, np.int32)
    out.setflags(write=False)
    return out


def check_heads(heads: int, degree: int, sp: int) -> None:
    """One sentence when the heads or the sp size do not split by the Ulysses degree."""
    if degree < 1 or sp % degree:
        raise ValueError(f"the Ulysses degree {degree} must divide the sp size {sp}")
    if heads % degree:
        raise ValueError(f"Ulysses over {degree} devices needs the query heads ({heads}) divisible "
                         f"by {degree}: use strategy 'usp' with a degree dividing {heads} and "
                         f"{sp}, or 'ring' / 'all_gather', which take any head count")


class _Groups:
    """This device's Ulysses group: U consecutive indices of the sp axis, sp / U groups."""

    def __init__(self, cfg, degree: int):
        self.cfg, self.degree, self.count = cfg, degree, cfg.sp // degree
        index = lax.axis_index(cfg.axis_name)
        self.group = index // degree
        # the collectives' groups (None: all of sp)
        self.members = None if self.count == 1 else [
            [g * degree + j for j in range(degree)] for g in range(self.count)]

    def shards_of(self, group):
        """The sequence shards of a group's devices, int32 [U] (traced)."""
        return group * self.degree + jnp.arange(self.degree, dtype=jnp.int32)

    def to_heads(self, x):
        """[b, L, n, ...] sequence shard of every head -> [U, b, L, n / U, ...]: the group's U
        sequence shards (in shard order) of this device's slice of the heads."""
        return lax.all_to_all(x[None], self.cfg.axis_name, split_axis=3, concat_axis=0, tiled=True,
                              axis_index_groups=self.members)

    def to_sequence(self, x):
        """The inverse of to_heads: [U, b, L, n / U, ...] -> [b, L, n, ...]."""
        return lax.all_to_all(x, self.cfg.axis_name, split_axis=0, concat_axis=3, tiled=True,
                              axis_index_groups=self.members)[0]

    def gather(self, x):
        """[b, L] of every device of the group, stacked [U, b, L]; None stays None."""
        return None if x is None else lax.all_gather(x, self.cfg.axis_name,
                                                     axis_index_groups=self.members)

    def shift(self, tree, hops: int):
        """Every leaf `hops` groups on around the ring of groups (device j to j + hops * U)."""
        hops %= self.count
        if hops == 0:
            return tree
        sp = self.cfg.sp
        perm = [(j, (j + hops * self.degree) % sp) for j in range(sp)]
        return jax.tree.map(lambda x: None if x is None else lax.ppermute(x, self.cfg.axis_name, perm),
                            tree)


def steps_with_pairs(active: np.ndarray, degree: int) -> tuple[int, ...]:
    """The steps of the ring of sp / degree groups at which some group holds a pair that
    `active` (bool [query shard, K/V shard]) keeps; (0,) when none does (host)."""
    sp = active.shape[0]
    count = sp // degree
    shards = lambda g: slice(g * degree, (g + 1) * degree)  # noqa: E731
    return tuple(s for s in range(count)
                 if any(active[shards(g), shards((g - s) % count)].any() for g in range(count))) or (0,)


@functools.lru_cache(maxsize=32)
def group_steps(cfg, degree: int) -> tuple[int, ...]:
    """The steps the program's ring of groups visits: those with a pair the mask keeps."""
    return steps_with_pairs(shard_pairs.pair_active(cfg), degree)


def _kv_to_heads(groups, cfg, x, slots):
    """K or V [b, L, kvh, h] -> this device's K/V slots of the group's shards, [U, ...] in the
    backend's travelling layout."""
    held = groups.to_heads(jnp.take(x, jnp.asarray(slots.reshape(-1)), axis=2))
    return jax.vmap(ring.step_backend(cfg).to_kv_layout)(held)


def _kv_to_sequence(groups, cfg, dx, slots, kv_heads):
    """dK or dV of the slots ([U, ...] float32, travelling layout) -> [b, L, kvh, h] float32 of
    this device's shard, replicated heads' contributions summed."""
    dx = groups.to_sequence(jax.vmap(ring.step_backend(cfg).from_kv_layout)(dx))
    b, L, _, h = dx.shape
    return jnp.zeros((b, L, kv_heads, h), dx.dtype).at[:, :, jnp.asarray(slots.reshape(-1))].add(dx)


def forward(cfg, q, k, v, qs, ks, aux, *, degree):
    """(out [b, L, n, h] in q's dtype, lse [b, L, n] float32) of this device's sequence shard."""
    groups = _Groups(cfg, degree)
    heads, kv_heads = q.shape[2], k.shape[2]
    slots = kv_head_slots(heads, kv_heads, degree)
    qh = groups.to_heads(ring.scaled_query(cfg, q))
    kv = (_kv_to_heads(groups, cfg, k, slots), _kv_to_heads(groups, cfg, v, slots), groups.gather(ks))
    qsh = groups.gather(qs)
    q_shards = groups.shards_of(groups.group)
    acc = shard_pairs.forward_start(cfg, qh, qsh, slots.shape[1])
    position = 0
    for step in group_steps(cfg, degree):
        kv = groups.shift(kv, step - position)
        position = step
        kv_shards = groups.shards_of((groups.group - step) % groups.count)
        acc = shard_pairs.forward(cfg, acc, qh, qsh, q_shards, kv, kv_shards, slots.shape[1])
    o, lse = shard_pairs.forward_end(cfg, acc)
    o, lse = ring.add_sinks(groups.to_sequence(o), groups.to_sequence(lse), aux)
    return o.astype(q.dtype), lse


def backward(cfg, res, do, *, degree):
    """(dq, dk, dv, None, None, d_aux): the gradients of this device's shards."""
    q, k, v, qs, ks, aux, out, lse = res
    groups = _Groups(cfg, degree)
    heads, kv_heads = q.shape[2], k.shape[2]
    slots = kv_head_slots(heads, kv_heads, degree)
    do, di, lse_k = ring.backward_inputs(q, out, lse, do)
    qh, doh = groups.to_heads(ring.scaled_query(cfg, q)), groups.to_heads(do)
    lseh, dih = groups.to_heads(lse_k), groups.to_heads(di)
    kv = (_kv_to_heads(groups, cfg, k, slots), _kv_to_heads(groups, cfg, v, slots), groups.gather(ks))
    qsh = groups.gather(qs)
    q_shards = groups.shards_of(groups.group)
    dq, dk, dv = shard_pairs.backward_start(cfg, qh, qsh, lseh, doh, dih, slots.shape[1],
                                            kv[0].shape)
    position = 0
    for step in group_steps(cfg, degree):
        # dK and dV travel with the K/V they belong to, as in the ring.
        kv, dk, dv = groups.shift((kv, dk, dv), step - position)
        position = step
        kv_shards = groups.shards_of((groups.group - step) % groups.count)
        dq, dk, dv = shard_pairs.backward(cfg, (dq, dk, dv), qh, qsh, lseh, doh, dih, q_shards, kv,
                                          kv_shards, slots.shape[1])
    dk, dv = groups.shift((dk, dv), -position)  # home
    dq = groups.to_sequence(shard_pairs.backward_end(cfg, dq))
    dk, dv = (_kv_to_sequence(groups, cfg, x, slots, kv_heads) for x in (dk, dv))
    return ((dq * cfg.scale).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None,
            ring.sink_gradient(aux, lse_k, di))
