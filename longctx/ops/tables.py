"""The ring's block tables: which (q block, kv block) pairs each (device, ring step) computes.

Static tables (host, numpy, cached per mask x layout x shapes). For every (device d, ring step s)
pair (device d's queries against the K/V shard that started on device (d - s) mod sp) the mask's
block pattern is known on the host: every (q block, kv block) is 0 empty / 1 partial / 2 full,
counted per query row from the mask's [lo, hi] key interval (a searchsorted on the block's sorted
positions; no O(L^2) dense mask is ever built); the partial blocks are materialised once,
deduplicated. From the classes, once:
  - splash `MaskInfo` arrays for the forward/dq kernels and for the dkv kernel, stacked as
    [device, run step, ...] so the ring body picks its own with `lax.axis_index` and the step;
  - the same blocks as a list of (q block, kv block) pairs per (device, step), for the XLA path;
  - ring pruning: the steps that are non-empty on some device (`run_steps`);
  - the schedule report: computed blocks per (device, step) and the efficiency
      useful blocks / (sp * sum over run steps of max over devices of computed blocks).

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

import jax.numpy as jnp
import numpy as np
from jax import lax

from longctx import layout as layout_lib
from longctx.masks import MaskSpec, default_block_size, make_mask_spec

def _block_classes(spec: MaskSpec, qpos, kpos, bq: int, bkv: int) -> np.ndarray:
    """int8 [q_blocks, kv_blocks]: 0 empty, 1 partial, 2 full (splash's block_mask values)."""
    lo, hi = spec.bounds(qpos)
    kb = np.sort(np.asarray(kpos, np.int64).reshape(-1, bkv), axis=1)
    step = kb[:, 1:2] - kb[:, :1] if bkv > 1 else np.ones((len(kb), 1), np.int64)
    if bkv == 1 or (np.diff(kb, axis=1) == step).all() and (step > 0).all():
        # Every layout here gives arithmetic progressions (stride 1, or sp for striped): the keys
        # start + stride*m inside [lo, hi] are m in [ceil((lo-start)/stride), floor((hi-start)/
        # stride)] clipped to [0, bkv-1]; counted for all rows and blocks at once.
        start, stride = kb[:, 0][None, :], step[:, 0][None, :]
        if (stride == 1).all():  # contiguous runs (no integer division: ~5x faster)
            first, last = lo[:, None] - start, hi[:, None] - start
        else:
            first, last = -((start - lo[:, None]) // stride), (hi[:, None] - start) // stride
        counts = np.minimum(last, bkv - 1) - np.maximum(first, 0) + 1
    else:  # general sets of positions: count with a binary search per block
        counts = np.empty((len(qpos), kb.shape[0]), np.int64)
        for j, ks in enumerate(kb):
            counts[:, j] = np.searchsorted(ks, hi, "right") - np.searchsorted(ks, lo, "left")
    counts = np.maximum(counts, 0).reshape(-1, bq, kb.shape[0])
    empty = (counts == 0).all(axis=1)
    full = (counts == bkv).all(axis=1)
    return np.where(empty, 0, np.where(full, 2, 1)).astype(np.int8)


@functools.lru_cache(maxsize=64)
def block_classes(spec: MaskSpec, layout: str, seq_len: int, num_shards: int,
                  bq: int, bkv: int) -> np.ndarray:
    """int8 [device, step, q_blocks, kv_blocks] for every step 0..sp-1 of the ring."""
    pos = layout_lib.shard_positions(layout, seq_len, num_shards)
    out = np.stack([
        np.stack([_block_classes(spec, pos[d], pos[(d - s) % num_shards], bq, bkv)
                  for s in range(num_shards)])
        for d in range(num_shards)])
    out.setflags(write=False)
    return out


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
    """Schedule stats of the ring for a mask and a (concrete) layout; block_size=None: default."""
    spec = make_mask_spec(causal, sliding_window, chunk_size)
    layout_lib.permutation(layout, seq_len, num_shards)  # validates layout and divisibility
    shard_len = seq_len // num_shards
    block = default_block_size(shard_len) if block_size is None else int(block_size)
    if block < 1 or shard_len % block:
        raise ValueError(f"block_size={block_size} does not divide the shard length "
                         f"{shard_len} (seq_len={seq_len} / num_shards={num_shards})")
    return schedule_from_classes(block_classes(spec, layout, seq_len, num_shards, block, block))


def ring_schedule_efficiency(seq_len, num_shards, block_size=None, layout="contiguous",
                             causal=False, sliding_window=None, chunk_size=None) -> float:
    return ring_schedule(seq_len, num_shards, block_size, layout, causal, sliding_window,
                         chunk_size).efficiency


@dataclasses.dataclass(frozen=True, eq=False)
class RingTables:
    """Everything static about the blocks of every (device, run step).

    classes: int8 [device, t, q_blocks, kv_blocks], the static class of each block (0/1/2).
    fwd_* index [device, t, 1, q_blocks, grid_width]: for q block i, the j-th non-empty kv
    block (data_next), its class (block_mask) and its partial-block id (mask_next); the forward
    and dq kernels share them. dkv_* index [device, t, 1, grid_height, kv_blocks]: the same,
    column-wise, for the dkv kernel. partial: bool [P, bq, bkv] (None when no partial block).
    pairs: int32 [device, t, max blocks, 2], the (q block, kv block) of every non-empty block in
    row-major order, padded with (0, 0) entries that `pair_valid` marks False (the XLA path).
    """
    run_steps: tuple[int, ...]
    active: np.ndarray           # bool [device, t]: any block to compute
    classes: np.ndarray
    pairs: np.ndarray
    pair_valid: np.ndarray
    kv_source: np.ndarray        # int32 [device, t]: device the visiting K/V started on
    q_positions: np.ndarray      # int32 [device, L]: global positions of each device's tokens
    fwd_data_next: np.ndarray
    fwd_block_mask: np.ndarray
    fwd_mask_next: np.ndarray | None
    dkv_data_next: np.ndarray
    dkv_block_mask: np.ndarray
    dkv_mask_next: np.ndarray | None
    partial: np.ndarray | None


def _pack(classes_rows, pids_rows, width):
    """Left-packs the non-empty entries of every row; pads by repeating the last index."""
    n_rows, n_cols = classes_rows.shape
    data = np.zeros((n_rows, width), np.int32)
    blk = np.zeros((n_rows, width), np.int32)
    mnext = np.zeros((n_rows, width), np.int32)
    for r in range(n_rows):
        cols = np.nonzero(classes_rows[r])[0]
        n = len(cols)
        if n:
            data[r, :n], blk[r, :n], mnext[r, :n] = cols, classes_rows[r, cols], pids_rows[r, cols]
            # Padding entries are skipped (block_mask 0) but still drive the DMA index maps:
            # repeating the last index means no extra fetch.
            data[r, n:], mnext[r, n:] = cols[-1], pids_rows[r, cols[-1]]
    return data, blk, mnext


@functools.lru_cache(maxsize=32)
def ring_tables(spec: MaskSpec, layout: str, seq_len: int, num_shards: int,
                bq: int, bkv: int) -> RingTables:
    sp = num_shards
    classes = block_classes(spec, layout, seq_len, sp, bq, bkv)
    run = schedule_from_classes(classes).run_steps
    cls = classes[:, list(run)]  # [sp, R, qb, kb]
    pos = layout_lib.shard_positions(layout, seq_len, sp)
    kv_pos = np.stack([[pos[(d - s) % sp] for s in run] for d in range(sp)])
    qb, kb = cls.shape[2:]

    # Materialise and deduplicate the partial blocks (bool [bq, bkv]).
    pids = np.zeros(cls.shape, np.int32)
    uniq: dict[bytes, int] = {}
    blocks = []
    for d, t, i, j in zip(*np.nonzero(cls == 1)):
        lo, hi = spec.bounds(pos[d, i * bq:(i + 1) * bq])
        kp = kv_pos[d, t, j * bkv:(j + 1) * bkv].astype(np.int64)
        blk = (kp[None, :] >= lo[:, None]) & (kp[None, :] <= hi[:, None])
        key = np.packbits(blk).tobytes()
        if key not in uniq:
            uniq[key] = len(blocks)
            blocks.append(blk)
        pids[d, t, i, j] = uniq[key]

    width = max(1, int((cls > 0).sum(axis=3).max()))   # forward grid width
    height = max(1, int((cls > 0).sum(axis=2).max()))  # dkv grid height
    R = len(run)
    fwd = [np.zeros((sp, R, 1, qb, width), np.int32) for _ in range(3)]
    dkv = [np.zeros((sp, R, 1, height, kb), np.int32) for _ in range(3)]
    for d in range(sp):
        for t in range(R):
            for arr, val in zip(fwd, _pack(cls[d, t], pids[d, t], width)):
                arr[d, t, 0] = val
            for arr, val in zip(dkv, _pack(cls[d, t].T, pids[d, t].T, height)):
                arr[d, t, 0] = val.T
    partial = np.stack(blocks) if blocks else None
    n_pairs = max(1, int((cls > 0).sum(axis=(2, 3)).max()))
    pairs = np.zeros((sp, R, n_pairs, 2), np.int32)
    pair_valid = np.zeros((sp, R, n_pairs), bool)
    for d in range(sp):
        for t in range(R):
            ij = np.argwhere(cls[d, t] > 0)  # row-major: a q block's kv blocks are consecutive
            pairs[d, t, :len(ij)], pair_valid[d, t, :len(ij)] = ij, True
    for table in (cls, pairs, pair_valid):
        table.setflags(write=False)
    return RingTables(
        run_steps=run,
        active=(cls > 0).any(axis=(2, 3)),
        classes=cls,
        pairs=pairs,
        pair_valid=pair_valid,
        kv_source=np.array([[(d - s) % sp for s in run] for d in range(sp)], np.int32),
        q_positions=pos.astype(np.int32),
        fwd_data_next=fwd[0], fwd_block_mask=fwd[1],
        fwd_mask_next=fwd[2] if blocks else None,
        dkv_data_next=dkv[0], dkv_block_mask=dkv[1],
        dkv_mask_next=dkv[2] if blocks else None,
        partial=partial)


# ----------------------------------------------------------------------------- dynamic (documents)

PADDING = 0  # segment ids <= PADDING are padding (the ring splits them into -1 and -2)


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


def skip_dead_entries(data_next, block_mask, mask_next, live, axis: int = -1):
    """Splash MaskInfo arrays, grid-packed along `axis`, with the entries that are not `live`
    switched off: block_mask 0 (not computed), and data_next / mask_next repeating the index of
    the nearest earlier live entry (the first live one at the start of a row), so the kernel's
    pipeline sees an unchanged block index and fetches nothing for them."""
    move = lambda x: None if x is None else jnp.moveaxis(x, axis, -1)  # noqa: E731
    data_next, block_mask, mask_next, live = map(move, (data_next, block_mask, mask_next, live))
    index = jnp.arange(live.shape[-1], dtype=jnp.int32)
    earlier = lax.cummax(jnp.where(live, index, -1), axis=live.ndim - 1)
    first = jnp.argmax(live, axis=-1).astype(jnp.int32)[..., None]
    source = jnp.where(earlier >= 0, earlier, first)
    take = lambda x: None if x is None else jnp.take_along_axis(x, source, axis=-1)  # noqa: E731
    back = lambda x: None if x is None else jnp.moveaxis(x, -1, axis)  # noqa: E731
    return back(take(data_next)), back(jnp.where(live, block_mask, 0)), back(take(mask_next))


@dataclasses.dataclass(frozen=True)
class DocumentSchedule:
    """What the ring computes for given rows of documents (the schedule report with documents).

    kept_blocks: blocks holding a (query, key) pair that the mask and the documents allow, i.e.
    the blocks any exact kernel must compute; computed_blocks [device, ring step]: the blocks
    the ring computes (live blocks), summed over the rows; both over every row given."""
    kept_blocks: int
    computed_blocks: np.ndarray
    run_steps: tuple[int, ...]

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
                      segment_ids: np.ndarray) -> DocumentSchedule:
    """The ring's schedule for natural-order rows of packed documents `segment_ids` [rows, S]
    (0 = padding), computed on the host with the same functions the ring runs on device. A step
    runs when some device has a live block in it (the ring skips a device's kernel, not the
    step: K/V still travel)."""
    ids = np.asarray(segment_ids, np.int32)
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
            for r, i, j in zip(*np.nonzero(live)):  # which live blocks are needed
                rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
                qi, kj = shard_ids[r, d, rows], shard_ids[r, src, cols]
                same = (qi[:, None] == kj[None, :]) & (qi > 0)[:, None]
                kept += bool((same & spec.allowed(pos[d, rows][:, None].astype(np.int64),
                                                  pos[src, cols][None, :].astype(np.int64))).any())
    run = tuple(int(s) for s in np.nonzero(computed.any(axis=0))[0])
    return DocumentSchedule(kept_blocks=kept, computed_blocks=computed, run_steps=run)
