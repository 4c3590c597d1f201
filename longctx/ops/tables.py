"""The ring's block tables: which (q block, kv block) pairs each (device, ring step) computes.

Every static mask here gives each query an interval of allowed key positions [lo, hi], and every
layout cuts a block into a few runs of evenly spaced positions (`block_runs`), so whether a block
(q block, kv block) is 0 empty / 1 partial / 2 full is counted per query row in closed form (on
device), or decided from the ends of the runs (on the host, for all sp^2 steps at once); no
O(L^2) dense mask is ever built.

Host (numpy, cached per mask x layout x shapes; `ring_tables`): the classes of every (device d,
ring step s) pair (device d's queries against the K/V shard that started on device (d - s) mod
sp), and from them only what is static about the program: the ring's pruning (`run_steps`, the
steps with work on some device), the kernels' grid sizes, and the schedule report (computed
blocks per (device, step) and the efficiency
    useful blocks / (sp * sum over run steps of max over devices of computed blocks)).

Device (per ring step, inside the ring): each device computes its own step's classes from its
index and the step (`step_blocks`, the same formula as the host's), then the kernels' tables:
the live blocks packed per row or column (`grid_tables`; a partial block's mask is computed in
the kernel from positions, ops/splash_kernels.py), or the list of (q block, kv block) pairs for
the XLA path (`step_pairs`). Tables built on the host and indexed by device would be
baked into the program as constants for every device at once: sp x steps x (L / block)^2
entries, hundreds of MiB at 2M tokens.

Dynamic tables (device, per batch row, every ring step) come from the segment ids. A block can
hold a same-document (query, key) pair only if the id ranges [first, last] of its queries and of
its keys overlap; blocks that the static mask keeps and whose ranges overlap are `live`, the rest
are neither computed nor fetched. The test is exact for packed rows (ids non-decreasing along the
sequence, so a block's ids are exactly the documents between its first and last) and safe for
any ids: when a same-document pair exists the ranges overlap, so a block that is needed is never
dropped; unordered ids only make the ranges wider and the ring slower, never wrong. Padding
(segment id <= 0) is ignored by the ranges: it attends to nothing and nothing attends to it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx.ops import row_blocks
from longctx.ops.masks import (MaskSpec, default_block_size, document_chunk_ids, make_mask_spec,
                               segment_positions, within_chunk_window)
from longctx.parallel import document_layout
from longctx.parallel import layout as layout_lib


def block_runs(layout: str, seq_len: int, num_shards: int, block: int):
    """Each block of `block` local indices as runs of evenly spaced global positions, the same
    on every shard: (first local index int [blocks, runs], length int [blocks, runs], stride).

    Positions run consecutively (stride 1) within a piece of the shard: the whole shard
    (contiguous), each half (zigzag), each stripe (striped); a block that crosses pieces is one
    run per piece. Every block gets as many runs as the most divided one, padded with empty runs
    (length 0). Token stripes (stripe width 1) are the one case of stride sp: one run a block."""
    L = seq_len // num_shards
    piece = layout_lib.piece_length(layout, L)
    if layout == "striped" and piece == 1:
        return np.arange(0, L, block)[:, None], np.full((L // block, 1), block), num_shards
    edges = [[start, *range((start // piece + 1) * piece, start + block, piece), start + block]
             for start in range(0, L, block)]
    runs = max(len(e) - 1 for e in edges)
    pad = lambda e, fill: list(e) + [fill] * (runs - len(e))  # noqa: E731
    first = np.array([pad(e[:-1], e[0]) for e in edges])
    length = np.array([pad(np.diff(e), 0) for e in edges])
    return first, length, 1


def _keys_in_bounds(xp, lo, hi, first_position, length, stride: int):
    """How many of the positions first_position + stride * m (0 <= m < length) lie in [lo, hi],
    broadcast over the arguments; numpy or jax (xp)."""
    if stride == 1:  # no integer division (~5x faster on the host)
        first, last = lo - first_position, hi - first_position
    else:
        first, last = -((first_position - lo) // stride), (hi - first_position) // stride
    return xp.maximum(xp.minimum(last, length - 1) - xp.maximum(first, 0) + 1, 0)


def _classes(xp, spec: MaskSpec, qpos, kv_first_positions, kv_lengths, stride: int,
             bq: int, bkv: int):
    """int32 [q_blocks, kv_blocks]: 0 empty, 1 partial, 2 full (splash's block_mask values), for
    queries at global positions qpos [L] and kv blocks given as runs ([kv blocks, runs] first
    positions and lengths), from each query's allowed key interval; numpy or jax (xp). Under jit
    the [L, kv blocks] counts fuse into the reductions: no [L, kv blocks] array is kept."""
    lo, hi = spec.bounds(qpos)
    counts = sum(_keys_in_bounds(xp, lo[:, None], hi[:, None], kv_first_positions[None, :, r],
                                 kv_lengths[None, :, r], stride)
                 for r in range(kv_lengths.shape[1]))
    counts = counts.reshape(-1, bq, counts.shape[1])
    empty = (counts == 0).all(axis=1)
    full = (counts == bkv).all(axis=1)
    return xp.where(empty, 0, xp.where(full, 2, 1)).astype(xp.int32)


@functools.lru_cache(maxsize=64)
def block_classes(spec: MaskSpec, layout: str, seq_len: int, num_shards: int,
                  bq: int, bkv: int) -> np.ndarray:
    """int8 [device, step, q_blocks, kv_blocks] for every step 0..sp-1 of the ring (host).

    The device's `_classes` counts every query row against every kv block: for the whole ring
    that is O(S^2 / bkv), 40 CPU-minutes at 4,194,304 tokens over sp=64. The host decides each
    block from the ends of its runs of positions instead (`_classes_of_runs`, O(S^2 / (bq bkv)),
    seconds), with the same result (tested against both). Token stripes' keys are spaced sp
    apart, so a window can fall between them, which a run's ends don't tell: those are counted
    per row, as on device.

    A per-row layout (layout.per_row) has no classes that hold for every row: every block is
    partial here (any may hold an allowed pair), and each row's are decided on device
    (row_blocks.py)."""
    if layout_lib.per_row(layout):
        if seq_len % num_shards or (seq_len // num_shards) % bq or (seq_len // num_shards) % bkv:
            raise ValueError(f"seq_len={seq_len} is not a multiple of num_shards={num_shards} "
                             f"x the blocks ({bq}, {bkv})")
        L = seq_len // num_shards
        out = np.ones((num_shards, num_shards, L // bq, L // bkv), np.int8)
        out.setflags(write=False)
        return out
    pos = layout_lib.shard_positions(layout, seq_len, num_shards).astype(np.int64)
    kv_first, kv_length, stride = block_runs(layout, seq_len, num_shards, bkv)
    if stride != 1:
        out = np.stack([
            np.stack([_classes(np, spec, pos[d], pos[(d - s) % num_shards][kv_first], kv_length,
                               stride, bq, bkv) for s in range(num_shards)])
            for d in range(num_shards)])
    else:
        q_first, q_length, _ = block_runs(layout, seq_len, num_shards, bq)
        out = np.stack([_classes_of_runs(spec, seq_len, pos[d], q_first, q_length,
                                         pos[(d - np.arange(num_shards)) % num_shards][:, kv_first],
                                         kv_length)
                        for d in range(num_shards)])
    out = out.astype(np.int8)
    out.setflags(write=False)
    return out


def _classes_of_runs(spec: MaskSpec, seq_len: int, qpos, q_first, q_length,
                     kv_first_positions, kv_lengths) -> np.ndarray:
    """int [steps, q_blocks, kv_blocks] classes (0 empty, 1 partial, 2 full) of one device's
    queries (global positions qpos [L]; q blocks as runs of consecutive positions, given by their
    local indices [q_blocks, q runs]) against the kv blocks visiting at each ring step (runs of
    consecutive positions: first positions [steps, kv_blocks, kv runs], lengths [kv_blocks,
    kv runs]).

    Over a run of consecutive queries both ends of the allowed interval [lo, hi] are
    non-decreasing, and each interval holds its own query (MaskSpec.bounds), so the run's
    intervals join into [lo(first), hi(last)] and meet in [lo(last), hi(first)]. A run of keys
    [a, b] is then touched by some query iff it meets the first, and allowed whole to every query
    iff it lies in the second. A block is full iff every pair of its runs is, empty iff no pair
    touches."""
    lo, hi = spec.bounds(qpos)
    a = kv_first_positions                                       # [step, kb, kr]
    b = a + kv_lengths - 1
    q_start = q_first[:, :, None, None, None]                   # [qb, qr, 1, 1, 1]
    q_last = q_start + q_length[:, :, None, None, None] - 1
    live = (q_length[:, :, None, None, None] > 0) & (kv_lengths > 0)
    touches = live & (lo[q_start] <= b) & (hi[np.maximum(q_last, 0)] >= a)
    covers = ~live | ((lo[np.maximum(q_last, 0)] <= a) & (hi[q_start] >= b))
    empty = ~touches.any(axis=(1, 4))                            # [qb, step, kb]
    full = covers.all(axis=(1, 4))
    return np.where(empty, 0, np.where(full, 2, 1)).transpose(1, 0, 2)


@dataclasses.dataclass(frozen=True)
class Schedule:
    computed_blocks: np.ndarray  # [device, step] blocks computed at every ring step 0..sp-1
    run_steps: tuple[int, ...]   # ring steps that are non-empty on some device, ascending
    efficiency: float

    @property
    def steps(self) -> int:
        return len(self.run_steps)

    @property
    def critical_path(self) -> int:
        """Blocks on the slowest path: sum over run steps of max over devices."""
        return int(sum(self.computed_blocks[:, s].max() for s in self.run_steps))


def schedule_from_classes(classes: np.ndarray) -> Schedule:
    computed = (classes > 0).sum(axis=(2, 3))
    run = tuple(int(s) for s in np.nonzero(computed.any(axis=0))[0])
    busiest = sum(int(computed[:, s].max()) for s in run)
    eff = float(computed.sum()) / (computed.shape[0] * busiest) if busiest else 1.0
    return Schedule(computed, run, eff)


def ring_schedule(seq_len: int, num_shards: int, block_size: int | None = None,
                  layout: str = "contiguous", causal: bool = False, sliding_window=None,
                  chunk_size=None) -> Schedule:
    """Schedule stats of the ring for a mask and a (concrete) layout; block_size=None: default.
    A per-row layout's: of a row of one document, laid out as its rows are."""
    spec = make_mask_spec(causal, sliding_window, chunk_size)
    if not layout_lib.per_row(layout):
        layout_lib.permutation(layout, seq_len, num_shards)  # validates layout and divisibility
    shard_len = seq_len // num_shards
    block = default_block_size(shard_len, layout) if block_size is None else int(block_size)
    if block < 1 or shard_len % block:
        raise ValueError(f"block_size={block_size} does not divide the shard length "
                         f"{shard_len} (seq_len={seq_len} / num_shards={num_shards})")
    if layout_lib.per_row(layout):
        one = document_schedule(spec, layout, seq_len, num_shards, block,
                                np.ones((1, seq_len), np.int32), count_kept=False)
        busiest = one.critical_path
        return Schedule(one.computed_blocks, one.run_steps,
                        float(one.computed_blocks.sum()) / (num_shards * busiest) if busiest else 1.0)
    return schedule_from_classes(block_classes(spec, layout, seq_len, num_shards, block, block))


def one_document_steps_visited(seq_len: int, num_shards: int, block_size: int, layout: str,
                               causal: bool = False, sliding_window=None, chunk_size=None) -> int:
    """Ring steps K/V travel through on rows of one document each, segment ids on (a training
    run's ring). They are the mask's run steps, except for a chunked mask: its chunks count from
    each document's start, so the ring runs the causal window a chunk spans and prunes by the
    chunks' ids; it stops after the last step with a chunk's blocks only where its steps are one
    run (zigzag, 131,072 tokens, sp=8, chunks of 8,192: 1 step has work, 3 are visited)."""
    if chunk_size is None and not layout_lib.per_row(layout):
        return len(ring_schedule(seq_len, num_shards, block_size, layout, causal, sliding_window).run_steps)
    spec = make_mask_spec(causal, sliding_window, chunk_size)
    return len(document_schedule(spec, layout, seq_len, num_shards, block_size,
                                 np.ones((1, seq_len), np.int32), count_kept=False).visited_steps)


def ring_schedule_efficiency(seq_len, num_shards, block_size=None, layout="contiguous",
                             causal=False, sliding_window=None, chunk_size=None) -> float:
    return ring_schedule(seq_len, num_shards, block_size, layout, causal, sliding_window,
                         chunk_size).efficiency


@dataclasses.dataclass(frozen=True, eq=False)
class RingTables:
    """What the host knows about the blocks of every (device, run step): the program's static
    shapes and the ring's pruning. Nothing here that grows with (L / block)^2 enters the
    program; each device builds its own step's blocks (`step_blocks`) and kernel tables.

    classes: int8 [device, t, q_blocks, kv_blocks], the class of each block (0/1/2), for the
    schedule report and tests. active: bool [device, t], any block to compute. kv_source: int32
    [device, t], the device the visiting K/V started on. grid_width / grid_height: the most
    blocks in one q-block row / kv-block column of a step (the forward kernel's grid width,
    the backward's grid height); max_pairs: the most blocks in one step.
    """
    run_steps: tuple[int, ...]
    active: np.ndarray
    classes: np.ndarray
    kv_source: np.ndarray
    grid_width: int
    grid_height: int
    max_pairs: int


def step_runs(steps):
    """(first run-step index, first ring step, length) of each run of consecutive ring steps."""
    runs = []
    for t, s in enumerate(steps):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([t, s, 1])
    return runs


def can_stop_early(run_steps) -> bool:
    """Whether a ring with documents may end after its last step with a live block (the ring's
    _steps_to_visit, the host's DocumentSchedule.visited_steps): its run steps are one run of
    several, so that the steps it visits are a prefix of them."""
    runs = step_runs(run_steps)
    return len(runs) == 1 and runs[0][2] > 1


@functools.lru_cache(maxsize=32)
def ring_tables(spec: MaskSpec, layout: str, seq_len: int, num_shards: int,
                bq: int, bkv: int) -> RingTables:
    sp = num_shards
    classes = block_classes(spec, layout, seq_len, sp, bq, bkv)
    run = schedule_from_classes(classes).run_steps
    cls = classes[:, list(run)]  # [sp, R, qb, kb]
    cls.setflags(write=False)
    kept = cls > 0
    return RingTables(
        run_steps=run,
        active=kept.any(axis=(2, 3)),
        classes=cls,
        kv_source=np.array([[(d - s) % sp for s in run] for d in range(sp)], np.int32),
        grid_width=max(1, int(kept.sum(axis=3).max())),
        grid_height=max(1, int(kept.sum(axis=2).max())),
        max_pairs=max(1, int(kept.sum(axis=(2, 3)).max())))


# ----------------------------------------------------------------------------- per step, on device

class StepBlocks(NamedTuple):
    """One device's blocks at one ring step, built on device: classes int32 [q_blocks,
    kv_blocks] (0/1/2), and the global positions of its queries and of the visiting keys, int32
    [L] each. In a per-row layout (`row_step_blocks`) each batch row has its own: classes [b,
    q_blocks, kv_blocks], positions [b, L], and the documents are in the classes already."""
    classes: jax.Array
    q_positions: jax.Array
    kv_positions: jax.Array


def step_blocks(spec: MaskSpec, layout: str, seq_len: int, num_shards: int, bq: int, bkv: int,
                device, kv_source) -> StepBlocks:
    """The blocks of `device`'s queries against the K/V that started on `kv_source` (traced ints),
    in closed form from the layout: equal to `block_classes(...)[device, step]` (tested)."""
    L = seq_len // num_shards
    position = functools.partial(layout_lib.positions_on_device, layout, seq_len, num_shards)
    q_positions = position(device, jnp.arange(L))
    kv_positions = position(kv_source, jnp.arange(L))
    first, length, stride = block_runs(layout, seq_len, num_shards, bkv)
    classes = _classes(jnp, spec, q_positions, kv_positions[first], jnp.asarray(length, jnp.int32),
                       stride, bq, bkv)
    return StepBlocks(classes, q_positions, kv_positions)


class RowTokens(NamedTuple):
    """What stays with the queries and travels with K/V in a per-row layout: the kernels'
    segment ids and each token's global position, int32 [b, L] each (a pytree: every strategy
    moves it as it moves the ids)."""
    ids: jax.Array
    positions: jax.Array


def ids_of(tokens):
    """The segment ids of a shard's tokens: `tokens` itself, or a RowTokens' ids (None: none)."""
    return tokens.ids if isinstance(tokens, RowTokens) else tokens


def row_step_blocks(spec: MaskSpec, q_parts: row_blocks.Parts, q: RowTokens, kv: RowTokens,
                    bkv: int, documents: bool = True) -> StepBlocks:
    """The blocks of a step in a per-row layout, from the queries' block summaries (computed
    once per call: row_blocks.parts) and the visiting K/V's ids and positions."""
    kv_parts = row_blocks.parts(kv.ids, kv.positions, bkv)
    return StepBlocks(row_blocks.classes(spec, q_parts, kv_parts, documents),
                      jnp.asarray(q.positions, jnp.int32), jnp.asarray(kv.positions, jnp.int32))


def grid_tables(classes, size: int, axis: int):
    """The kernels' tables (data_next, block_mask) of one step, each [rows, 1, q_blocks, size]
    packed along the kv axis (axis=-1: the forward) or [rows, 1, size, kv_blocks] along the q
    axis (axis=-2: the backward): the live blocks of each row/column in order, then entries
    that compute and fetch nothing (skip_dead_entries). So the first n entries of every
    row/column are a table of grid size n wherever no row/column has more than n live blocks.
    classes: int32 [rows, q_blocks, kv_blocks], the kernel's class of each block (0 not
    computed, 1 partial, 2 full: `kernel_classes`)."""
    live = classes != 0
    move = lambda x: jnp.moveaxis(x, axis, -1)  # noqa: E731
    # stable sort: the live entries first, in block order
    order = jnp.argsort(jnp.logical_not(move(live)), axis=-1, stable=True)[..., :size]
    order = order.astype(jnp.int32)
    take = lambda x: jnp.take_along_axis(move(x), order, axis=-1)  # noqa: E731
    data, block = skip_dead_entries(order, take(classes), take(live), axis=-1)
    back = lambda x: jnp.moveaxis(x, -1, axis)[:, None]  # noqa: E731
    return back(data), back(block)


def live_rows_first(data_next, block_mask):
    """The forward kernel's tables (grid_tables(axis=-1): [..., q_blocks, width]) with their
    q-block rows reordered: the rows that hold a live entry first, in block order, then the
    rest. Returns ((data_next, block_mask), q_blocks int32 [..., q_blocks]: the q block of each
    table row). With documents most q blocks have nothing to compute at most ring steps; a
    kernel whose grid ends after the live rows walks none of them."""
    dead = jnp.logical_not(jnp.any(block_mask != 0, axis=-1))
    order = jnp.argsort(dead, axis=-1, stable=True).astype(jnp.int32)
    take = lambda x: jnp.take_along_axis(x, order[..., None], axis=-2)  # noqa: E731
    return (take(data_next), take(block_mask)), order


def step_pairs(blocks, max_pairs: int):
    """The nonzero entries of `blocks` ([q_blocks, kv_blocks] classes or live flags, or live
    flags [rows, q_blocks, kv_blocks]) as index tuples, (q block, kv block) or (row, q block,
    kv block), in row-major order: int32 [max_pairs, blocks.ndim], and how many of them are real
    (the rest repeat (0, 0[, 0]))."""
    index = jnp.nonzero(blocks, size=max_pairs, fill_value=0)
    return jnp.stack(index, axis=-1).astype(jnp.int32), jnp.count_nonzero(blocks)


# ----------------------------------------------------------------------------- dynamic (documents)

PADDING = row_blocks.PADDING  # segment ids <= PADDING are padding (the ring splits them into -1 and -2)


def document_ranges(segment_ids, block: int):
    """(first, last) int32 [b, L // block]: the smallest and largest document id in each block of
    `block` tokens, padding ignored (an all-padding block gets first > last, an empty range)."""
    b, L = segment_ids.shape
    ids = segment_ids.reshape(b, L // block, block)
    real = ids > PADDING
    first = jnp.min(jnp.where(real, ids, jnp.iinfo(jnp.int32).max), axis=-1)
    last = jnp.max(jnp.where(real, ids, PADDING), axis=-1)
    return first, last


def live_blocks(static_classes, q_ranges, kv_ranges):
    """bool [b, q_blocks, kv_blocks]: blocks the static mask keeps whose queries and keys can be
    in one document. Without segment ids (ranges None) every kept block is live."""
    kept = jnp.asarray(static_classes) > 0
    if q_ranges is None:
        return kept[None]
    (q_first, q_last), (kv_first, kv_last) = q_ranges, kv_ranges
    overlap = (q_first[:, :, None] <= kv_last[:, None, :]) & (kv_first[:, None, :] <= q_last[:, :, None])
    return kept[None] & overlap


def block_documents(segment_ids, block: int):
    """int32 [b, L // block]: the document id that fills each block of `block` tokens whole, or
    0 where the block holds two documents or any padding."""
    b, L = segment_ids.shape
    ids = segment_ids.reshape(b, L // block, block)
    first = ids[..., 0]
    whole = jnp.all(ids == first[..., None], axis=-1) & (first > PADDING)
    return jnp.where(whole, first, 0).astype(jnp.int32)


def kernel_classes(static_classes, live, q_documents, kv_documents):
    """int32 [b or 1, q_blocks, kv_blocks]: how the kernels treat each block of the step. 0 not
    computed (not `live`); 2 full, no element masked: a block the static mask keeps whole whose
    queries and keys all belong to one document (`block_documents` of each side; None without
    documents); 1 partial, masked element by element, otherwise."""
    full = jnp.asarray(static_classes) == 2
    if q_documents is not None:
        full = full & ((q_documents[:, :, None] == kv_documents[:, None, :])
                       & (q_documents[:, :, None] > 0))
    return jnp.where(live, jnp.where(full, 2, 1), 0).astype(jnp.int32)


def skip_dead_entries(data_next, block_mask, live, axis: int = -1):
    """Kernel tables, grid-packed along `axis`, with the entries that are not `live` switched
    off: block_mask 0 (not computed), and data_next repeating the index of the nearest earlier
    live entry (the first live one at the start of a row), so the kernel's pipeline sees an
    unchanged block index and fetches nothing for them."""
    move = lambda x: jnp.moveaxis(x, axis, -1)  # noqa: E731
    data_next, block_mask, live = map(move, (data_next, block_mask, live))
    index = jnp.arange(live.shape[-1], dtype=jnp.int32)
    earlier = lax.cummax(jnp.where(live, index, -1), axis=live.ndim - 1)
    first = jnp.argmax(live, axis=-1).astype(jnp.int32)[..., None]
    source = jnp.where(earlier >= 0, earlier, first)
    back = lambda x: jnp.moveaxis(x, -1, axis)  # noqa: E731
    return back(jnp.take_along_axis(data_next, source, axis=-1)), back(jnp.where(live, block_mask, 0))


@dataclasses.dataclass(frozen=True)
class DocumentSchedule:
    """What the ring computes for given rows of documents (the schedule report with documents).

    kept_blocks: blocks holding a (query, key) pair that the mask and the documents allow, i.e.
    the blocks any exact kernel must compute; computed_blocks [device, ring step]: the blocks
    the ring computes (live blocks), summed over the rows; both over every row given.
    run_steps: the ring steps with a live block on some device; visited_steps: the ring steps
    the ring goes through, K/V travelling one hop each (its kernels skipped where nothing is
    live): the static mask's run steps, cut after the last one that runs where they are one run
    of several (`can_stop_early`, as ring._steps_to_visit does on device)."""
    kept_blocks: int | None  # None where not counted (document_schedule's count_kept)
    computed_blocks: np.ndarray
    run_steps: tuple[int, ...]
    visited_steps: tuple[int, ...]

    @property
    def critical_path(self) -> int:
        """Blocks on the slowest path: sum over the steps that run of the busiest device's."""
        return int(sum(self.computed_blocks[:, s].max() for s in self.run_steps))

    @property
    def efficiency(self) -> float:
        """kept / (sp x critical path): 1 when every device computes only needed blocks and all
        are equally busy at every step."""
        busiest = self.critical_path
        return self.kept_blocks / (self.computed_blocks.shape[0] * busiest) if busiest else 1.0


def document_schedule(spec: MaskSpec, layout: str, seq_len: int, num_shards: int, block: int,
                      segment_ids: np.ndarray, *, count_kept: bool = True,
                      positions: np.ndarray | None = None) -> DocumentSchedule:
    """The ring's schedule for natural-order rows of packed documents `segment_ids` [rows, S]
    (0 = padding), computed on the host with the same functions the ring runs on device. A step
    runs when some device has a live block in it. The ring skips a device's kernel, not the
    step (K/V still travel), except after the last step that runs, where it stops (when the
    static run steps are one run: ring._steps_to_visit; `visited_steps`).
    count_kept=False leaves kept_blocks None: what the ring computes, without the element-wise
    count of which blocks are needed (minutes at 128K tokens; a second without it).
    A chunked mask counts chunks from each document's start, as the ring does with documents:
    the ids become the documents' chunks (from `positions`, default in-document) and the static
    mask the causal window a chunk spans (masks.document_chunk_ids, masks.within_chunk_window)."""
    if layout_lib.per_row(layout):
        return _row_layout_schedule(spec, seq_len, num_shards, block, segment_ids, count_kept,
                                    positions)
    ids = np.asarray(segment_ids, np.int32)
    if spec.chunk is not None:
        ids = document_chunk_ids(ids, spec.chunk, positions)
        spec = within_chunk_window(spec)
    sp, shard = num_shards, seq_len // num_shards
    tb = ring_tables(spec, layout, seq_len, sp, block, block)
    pos = layout_lib.shard_positions(layout, seq_len, sp)
    shard_ids = ids[:, np.asarray(pos).reshape(-1)].reshape(len(ids), sp, shard)
    computed = np.zeros((sp, sp), np.int64)
    kept = 0
    for d in range(sp):
        q_ranges = document_ranges(shard_ids[:, d], block)
        for t, s in enumerate(tb.run_steps):
            src = (d - s) % sp
            live = np.asarray(live_blocks(tb.classes[d, t], q_ranges,
                                          document_ranges(shard_ids[:, src], block)))
            computed[d, s] = live.sum()
            if not count_kept:
                continue
            for r, i, j in zip(*np.nonzero(live)):  # which live blocks are needed
                rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
                qi, kj = shard_ids[r, d, rows], shard_ids[r, src, cols]
                same = (qi[:, None] == kj[None, :]) & (qi > 0)[:, None]
                kept += bool((same & spec.allowed(pos[d, rows][:, None].astype(np.int64),
                                                  pos[src, cols][None, :].astype(np.int64))).any())
    run = tuple(int(s) for s in np.nonzero(computed.any(axis=0))[0])
    static = tb.run_steps
    visited = static
    if can_stop_early(static):
        visited = static[:static.index(max(run)) + 1] if run else static[:1]
    return DocumentSchedule(kept_blocks=kept if count_kept else None, computed_blocks=computed,
                            run_steps=run, visited_steps=visited)


def row_layout_inputs(spec: MaskSpec, segment_ids, num_shards: int, block: int, positions=None):
    """(mask, kernel ids, global positions) of one natural-order row [S] in the per-document
    layout, in layout order, as the ring sees them: the row's renumbered ids (or with a chunked
    mask each document's chunks, ring._kernel_segment_ids) and segment id - 1 + in-document
    position (`positions`, default the in-document ones)."""
    row = document_layout.row_layout(segment_ids, num_shards, block)
    natural = segment_positions(segment_ids) if positions is None else np.asarray(positions)
    in_document = natural[row.permutation].astype(np.int64)
    ids = row.segment_ids.astype(np.int64)
    where = document_layout.global_positions(ids, in_document)
    if spec.chunk is not None:
        ids = np.where(ids > 0, where - in_document % spec.chunk + 1, ids)
        spec = within_chunk_window(spec)
    return spec, ids.astype(np.int32), where.astype(np.int32)


def _row_layout_schedule(spec: MaskSpec, seq_len: int, num_shards: int, block: int, segment_ids,
                         count_kept: bool, positions) -> DocumentSchedule:
    """document_schedule in the per-document layout: each row laid out on its own, its blocks
    classed from its data (row_blocks.py) as the ring does on device; the ring visits the steps
    up to the last with a live block (ring._steps_to_visit)."""
    sp, shard = num_shards, seq_len // num_shards
    computed = np.zeros((sp, sp), np.int64)
    kept = 0
    for r, row in enumerate(np.asarray(segment_ids)):
        row_spec, ids, where = row_layout_inputs(spec, row, sp, block,
                                                 None if positions is None else positions[r])
        ids, where = ids.reshape(sp, shard), where.reshape(sp, shard)
        # every device at once: the shards are the batch rows of one call per ring step
        parts = row_blocks.parts(ids, where, block)
        for s in range(sp):
            source = (np.arange(sp) - s) % sp
            visiting = jax.tree.map(lambda x: x[source], parts)
            live = row_blocks.classes(row_spec, parts, visiting) > 0  # [device, qb, kb]
            computed[:, s] += live.sum(axis=(1, 2))
            if not count_kept:
                continue
            for d, i, j in zip(*np.nonzero(live)):  # which live blocks are needed
                src = source[d]
                qi, kj = ids[d, i * block:(i + 1) * block], ids[src, j * block:(j + 1) * block]
                qp = where[d, i * block:(i + 1) * block].astype(np.int64)
                kp = where[src, j * block:(j + 1) * block].astype(np.int64)
                same = (qi[:, None] == kj[None, :]) & (qi > 0)[:, None]
                kept += bool((same & row_spec.allowed(qp[:, None], kp[None, :])).any())
    run = tuple(int(s) for s in np.nonzero(computed.any(axis=0))[0])
    visited = tuple(range(max(run) + 1)) if run else (0,)
    return DocumentSchedule(kept_blocks=kept if count_kept else None, computed_blocks=computed,
                            run_steps=run, visited_steps=visited)
