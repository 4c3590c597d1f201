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

As strategies: `Ulysses` here, `UlyssesRing` (usp) in usp.py, both `UlyssesGroups`: the
schedule, the price and the working memory of U-device groups around a ring of sp / U groups.
Schedule: at step s of the ring of groups, each device of group g computes the pairs of g's U
query shards against group (g - s)'s U K/V shards for 1/U of the heads (Ulysses: one step, every
device every pair, all devices equal). Price: the all-to-alls of Q, K, V, the output and the
logsumexp (and the backward's), over the group, exposed (the kernel needs their result, and they
need its); the group's segment ids gathered; the ring of groups' pass of K/V (and dK/dV), issued
before each step's blocks as the ring's is, so it hides behind them.
"""
from __future__ import annotations

import abc
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx.ops import ring, shard_pairs, strategy, strategy_schedule


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


def degrees_in_words(heads: int, sp: int) -> tuple[list[int], str]:
    """(the Ulysses degrees above 1 that divide both sp and the heads, those as "{2, 4}")."""
    fits = [u for u in range(2, sp + 1) if sp % u == 0 and heads % u == 0]
    return fits, "{" + ", ".join(map(str, fits)) + "}"


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
        """[b, L] of every device of the group, stacked [U, b, L] (each leaf of a
        tables.RowTokens); None stays None."""
        return jax.tree.map(lambda leaf: lax.all_gather(leaf, self.cfg.axis_name,
                                                        axis_index_groups=self.members), x)

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


class UlyssesGroups(strategy.Strategy):
    """Ulysses over groups of `ulysses_degree(sp)` devices, around a ring of the groups: what
    Ulysses (one group) and usp (several) share."""
    # K/V of the group's shards held at once: 2 where the ring of groups has a pass in flight
    kv_buffers: int

    @abc.abstractmethod
    def ulysses_degree(self, sp: int) -> int:
        """U: the devices of a group (sp for Ulysses)."""

    def check(self, heads, sp):
        check_heads(heads, self.ulysses_degree(sp), sp)

    def forward(self, cfg, q, k, v, qs, ks, aux):
        return forward(cfg, q, k, v, qs, ks, aux, degree=self.ulysses_degree(cfg.sp))

    def backward(self, cfg, res, do):
        return backward(cfg, res, do, degree=self.ulysses_degree(cfg.sp))

    def from_step_blocks(self, per_step, ring_critical_path, kept, ring_steps, static_pairs):
        sp = per_step.shape[0]
        degree = self.ulysses_degree(sp)
        groups = sp // degree
        pairs = strategy_schedule.by_pair(per_step)
        shards = lambda g: slice(g * degree, (g + 1) * degree)  # noqa: E731
        # step_work[g, s]: blocks of group g's pairs at group step s, shared by its U devices
        step_work = np.array([[pairs[shards(g), shards((g - s) % groups)].sum() for s in range(groups)]
                              for g in range(groups)], float) / degree
        critical = float(sum(step_work[:, s].max() for s in range(groups)))
        visited = steps_with_pairs(static_pairs, degree)
        return strategy_schedule.StrategySchedule(self.name, degree,
                                                  np.repeat(step_work, degree, axis=0), critical,
                                                  kept, len(visited))

    def dead_grid_steps(self, live):
        sp, nq = live.shape[0], live.shape[2]
        u = self.ulysses_degree(sp)
        groups = sp // u
        # [a, s, block]: the live kv blocks of each row, the live q blocks of each column
        rows, cols = live.sum(axis=3), live.sum(axis=2)
        a = np.arange(sp)
        # [a, K/V shard c, block]: device a's rows (columns) against the K/V shard c
        shard_of_step = (a[:, None] - a[None, :]) % sp                  # [a, c] -> ring step
        rows_pair = rows[a[:, None], shard_of_step]
        cols_pair = cols[a[:, None], shard_of_step]
        dead_rows = dead_cols = 0.0
        for t in range(groups):
            widths, heights, group_work = [], [], []
            for g in range(groups):
                q, kv = slice(g * u, (g + 1) * u), slice(((g - t) % groups) * u, ((g - t) % groups + 1) * u)
                widths.append(rows_pair[q, kv].sum(axis=1).max())        # a row over the U K/V shards
                heights.append(cols_pair[q, kv].sum(axis=0).max())       # a column over the U q shards
                group_work.append(rows_pair[q, kv].sum())
            critical = max(group_work) / u
            if critical:
                # a call covers U shards of q and K/V for 1/U of the heads: (U nq x width) / U blocks
                dead_rows += nq * max(widths) - critical
                dead_cols += nq * max(heights) - critical
        return float(dead_rows), float(dead_cols)

    def transfers(self, shape, cfg, steps=None):
        b, L, n, h, e = shape.batch, shape.shard_len, shape.heads, shape.head_dim, shape.dtype_bytes
        u = self.ulysses_degree(shape.sp)
        groups = shape.sp // u
        slots = kv_head_slots(n, shape.kv_heads, u).shape[1]  # K/V heads a device holds
        a2a = lambda x: (u - 1) * x // u  # noqa: E731  all-to-all of x bytes per device
        q, q32, row32 = b * L * n * h * e, b * L * n * h * 4, b * L * n * 4
        held, held32 = b * L * u * slots * h * e, b * L * u * slots * h * 4  # K (dK) slots sent
        gathers = 2 * (u - 1) * shape.ids_bytes  # query and K/V segment ids of the group
        steps = group_steps(cfg, u) if steps is None else steps
        sends, last = strategy.ring_sends(steps, groups)
        home = 1 if last % groups else 0
        travel = 2 * held + u * shape.ids_bytes  # K, V slots of the group's U shards (+ their ids)

        def kinds(to_all, permute):
            return (strategy.Transfer("all_to_all", to_all, 1, u, under_blocks=False),
                    strategy.Transfer("all_gather", gathers, 1, u, under_blocks=False),
                    strategy.Transfer("permute", permute, max(1, len(steps)), 2, under_blocks=True,
                                      stride=u))

        backward = 2 * a2a(q) + 2 * a2a(row32) + 2 * a2a(held) + a2a(q32) + 2 * a2a(held32)
        return {"forward": kinds(a2a(q) + 2 * a2a(held) + a2a(q32) + a2a(row32), sends * travel),
                "backward": kinds(backward, sends * (travel + 2 * held32) + home * 2 * held32)}

    def kernel_calls(self, cfg, travelled):
        return max(1.0, float(travelled))

    def working_bytes(self, shape, cfg):
        u = self.ulysses_degree(shape.sp)
        slots = kv_head_slots(shape.heads, shape.kv_heads, u).shape[1]
        tokens = shape.batch * shape.shard_len * u  # the group's tokens, 1/u of the heads
        e, h = shape.dtype_bytes, shape.head_dim
        q_like = tokens * (shape.heads // u) * h * (2 * e + 4 + 4)  # q, out, dq and d_out float32
        return q_like + tokens * slots * h * 2 * (e + 4) * self.kv_buffers


class Ulysses(UlyssesGroups):
    name = "ulysses"
    simplicity = 3
    layout_matters = False  # every device computes every query shard, for its heads
    kv_buffers = 1

    @classmethod
    def candidates(cls, heads, sp):
        return [cls()] if sp > 1 and heads % sp == 0 else []

    @classmethod
    def config_problem(cls, heads, sp, degree, cp_key, degree_key):
        if heads % sp == 0:
            return None
        fits, degrees = degrees_in_words(heads, sp)
        other = f"{cp_key}=usp with {degree_key} in {degrees}, or " if fits else ""
        return (f"{cp_key}=ulysses splits the query heads over the sp devices, but "
                f"model.num_heads={heads} is not divisible by sp={sp}: use {other}"
                f"{cp_key}=ring or all_gather, which take any head count.")

    def ulysses_degree(self, sp):
        return sp

    def steps_in_words(self, cfg):
        return "one all-to-all each way"
