"""The blocks of a ring step in a per-row layout, worked out from the data.

A static layout tells every device in closed form which global positions each shard holds
(ops/tables.py). A per-row layout (parallel/document_layout.py) does not: each token's global
position is data, [b, L] per shard, and travels with K/V as the segment ids do. So a block's
class is decided here from summaries of its tokens, per batch row, at every step.

A block's tokens are summarized by the documents they belong to (the kernels' segment ids: a
document, or a chunk of one): its first document (the id of its first real token) with the
lowest and highest position of that document's tokens in the block, its last document likewise,
and the rest (the range of their ids and of their positions). A (q block, kv block) pair holds
an allowed (query, key) pair only if some part of the one and some part of the other can share
a document (their id ranges meet) and the mask lets some query position of the first reach some
key position of the second (MaskSpec.bounds: the queries of positions [lo, hi] reach keys in
[lo(lo), hi(hi)], both ends non-decreasing). The test is safe for any data: a pair of the same
document in both blocks is one of the parts' pairs, within both parts' ranges. It is exact when
each document's tokens in a block are one run of positions and the documents strictly inside a
block occur nowhere else, as in the per-document layout (shards ordered by its numbering, spread
documents as whole blocks): then the ring computes only blocks that hold a needed pair.

A block is full (computed without an element mask) when one document fills both blocks whole
and every query may see every key: lo(highest query) <= lowest key and hi(lowest query) >=
highest key (the intersection of the queries' intervals).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from longctx.ops.masks import MaskSpec

PADDING = 0  # segment ids <= PADDING are padding
_FAR = 2 ** 30  # beyond every position and id (int32 on device): an empty part's bounds


class Span(NamedTuple):
    """Ids [id_lo, id_hi] and positions [lo, hi] of some of a block's tokens, [b, blocks] each;
    id_lo > id_hi where there are none."""
    id_lo: object
    id_hi: object
    lo: object
    hi: object


class Parts(NamedTuple):
    """A shard's blocks summarized ([b, blocks] arrays): the first document, the last, the rest,
    all real tokens together, and the document filling the block whole (0: none)."""
    first: Span
    last: Span
    rest: Span
    every: Span
    whole: object


def parts(segment_ids, positions, block: int) -> Parts:
    """The Parts of each block of `block` tokens of rows [b, L] of ids and global positions
    (jax arrays on device; numpy on the host, for the schedule report)."""
    xp = jnp if isinstance(segment_ids, jax.Array) else np
    b, L = segment_ids.shape
    x = segment_ids.astype(xp.int32).reshape(b, L // block, block)
    g = positions.astype(xp.int32).reshape(b, L // block, block)
    real = x > PADDING

    def end_id(index):
        return xp.take_along_axis(x, index[..., None], axis=-1)[..., 0]

    first = end_id(xp.argmax(real, axis=-1))
    last = end_id(block - 1 - xp.argmax(real[..., ::-1], axis=-1))

    def span(mask):
        return Span(xp.min(xp.where(mask, x, _FAR), axis=-1), xp.max(xp.where(mask, x, -_FAR), axis=-1),
                    xp.min(xp.where(mask, g, _FAR), axis=-1), xp.max(xp.where(mask, g, -_FAR), axis=-1))

    in_first = real & (x == first[..., None])
    in_last = real & (x == last[..., None])
    whole = xp.all(x == x[..., :1], axis=-1) & (x[..., 0] > PADDING)
    return Parts(span(in_first), span(in_last), span(real & ~in_first & ~in_last), span(real),
                 xp.where(whole, x[..., 0], 0))


def _meet(spec: MaskSpec, q: Span, kv: Span, documents: bool):
    """bool [b, q blocks, kv blocks]: whether some query of `q` may see some key of `kv`."""
    lo, _ = spec.bounds(q.lo)
    _, hi = spec.bounds(q.hi)
    ok = (lo[:, :, None] <= kv.hi[:, None, :]) & (hi[:, :, None] >= kv.lo[:, None, :])
    ok = ok & (q.lo[:, :, None] <= q.hi[:, :, None]) & (kv.lo[:, None, :] <= kv.hi[:, None, :])
    if documents:
        ok = ok & (q.id_lo[:, :, None] <= kv.id_hi[:, None, :]) & (kv.id_lo[:, None, :] <= q.id_hi[:, :, None])
    return ok


def classes(spec: MaskSpec, q: Parts, kv: Parts, documents: bool = True):
    """int32 [b, q blocks, kv blocks]: 0 no allowed pair (not computed), 1 partial, 2 full.
    documents=False: by positions alone (every real token's range; the element mask still
    compares segment ids), as a ring that does not skip blocks by documents."""
    if documents:
        live = None
        for a in (q.first, q.last, q.rest):
            for c in (kv.first, kv.last, kv.rest):
                meet = _meet(spec, a, c, True)
                live = meet if live is None else live | meet
    else:
        live = _meet(spec, q.every, kv.every, False)
    lo, _ = spec.bounds(q.every.hi)
    _, hi = spec.bounds(q.every.lo)
    full = ((lo[:, :, None] <= kv.every.lo[:, None, :]) & (hi[:, :, None] >= kv.every.hi[:, None, :])
            & (q.whole[:, :, None] == kv.whole[:, None, :]) & (q.whole[:, :, None] > PADDING))
    xp = jnp if isinstance(live, jax.Array) else np
    return xp.where(live, xp.where(full, 2, 1), 0).astype(xp.int32)
