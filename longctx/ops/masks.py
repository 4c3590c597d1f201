"""What the masks mean.

Every static mask here (full, causal, sliding window, chunked causal and their AND) is, for a
query at global position i, an interval of allowed key positions [lo(i), hi(i)] (`MaskSpec`).
Documents are data, not a static mask: segment ids (`longctx.ops.tables` turns both into the
ring's block tables); auto_layout.py picks the layout whose ring finishes first for a mask.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longctx.parallel import layout as layout_lib

# "Unbounded" interval ends: positions are < 2**62 on the host (int64) and < 2**30 on device
# (int32, where lo - position and position - hi must not overflow).
_BIG = np.int64(2) ** 62
_BIG_ON_DEVICE = 2 ** 30
# The longest window side a MaskSpec holds: one of 2**30 already reaches every position a device
# holds, and a longer one (2**31 - 1, "unbounded") would wrap pos + window past int32 on device.
MAX_WINDOW = _BIG_ON_DEVICE


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """AND of the mask terms, in global positions. window = (left, right): j in [i-left, i+right]."""
    causal: bool = False
    window: tuple[int, int] | None = None
    chunk: int | None = None

    def bounds(self, pos):
        """Allowed key interval [lo, hi] (inclusive) for queries at global positions `pos`:
        int64 numpy for host positions, int32 jax for positions computed on device. Both ends
        are non-decreasing in the position, and the interval holds the position itself (windows
        are non-negative, make_mask_spec): ops/tables.py relies on both."""
        if isinstance(pos, jax.Array):
            xp, pos, big = jnp, pos.astype(jnp.int32), _BIG_ON_DEVICE
        else:
            xp, pos, big = np, np.asarray(pos, np.int64), _BIG
        lo = xp.full_like(pos, -big)
        hi = xp.full_like(pos, big)
        if self.causal or self.chunk is not None:
            hi = xp.minimum(hi, pos)
        if self.window is not None:
            lo = xp.maximum(lo, pos - self.window[0])
            hi = xp.minimum(hi, pos + self.window[1])
        if self.chunk is not None:
            lo = xp.maximum(lo, pos // self.chunk * self.chunk)
        return lo, hi

    def allowed(self, qpos, kpos):
        """Elementwise mask for broadcastable position arrays (numpy or jax.numpy)."""
        ok = (qpos == qpos) & (kpos == kpos)  # all-True of the broadcast shape, either library
        if self.causal or self.chunk is not None:
            ok = ok & (kpos <= qpos)
        if self.window is not None:
            ok = ok & (kpos >= qpos - self.window[0]) & (kpos <= qpos + self.window[1])
        if self.chunk is not None:
            ok = ok & (qpos // self.chunk == kpos // self.chunk)
        return ok


def within_chunk_window(spec: MaskSpec) -> MaskSpec:
    """The static part of chunked causal attention whose chunks start at each document's start
    (the chunks themselves are data: the ring turns them into segment ids): causal, and no
    further back than chunk - 1 keys, intersected with any window of `spec`."""
    left, right = spec.window if spec.window is not None else (spec.chunk - 1, 0)
    return MaskSpec(causal=True, window=(min(left, spec.chunk - 1), min(right, 0)), chunk=None)


def segment_positions(segment_ids) -> np.ndarray:
    """Each token's position in its document (int32): 0, 1, ... restarting wherever the segment
    id changes along the last axis; 0 on padding (id <= 0). The positions data.packing packs into
    every row (RoPE's, and the ring's chunk ids'), here because ops and data both need them."""
    ids = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(ids.shape[-1], dtype=np.int32), ids.shape)
    starts = np.ones(ids.shape, dtype=bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    start_idx = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return np.where(ids > 0, idx - start_idx, 0).astype(np.int32)


def document_chunk_ids(segment_ids, chunk: int, positions=None) -> np.ndarray:
    """The host's twin of the ring's per-document chunk ids (ring._kernel_segment_ids) for
    natural-order rows [rows, S]: 1 + the column where each token's chunk starts, column minus
    (in-document position mod chunk); padding (id <= 0) kept. `positions` default to the
    in-document ones (`segment_positions`, as data.packing packs rows). With these ids and
    `within_chunk_window`, the tables see what the ring computes."""
    ids = np.asarray(segment_ids, np.int64)
    col = np.broadcast_to(np.arange(ids.shape[-1]), ids.shape)
    if positions is None:
        positions = segment_positions(ids)
    chunk_start = col - np.asarray(positions, np.int64) % chunk + 1
    return np.where(ids > 0, chunk_start, ids).astype(np.int32)


def make_mask_spec(causal=False, sliding_window=None, chunk_size=None) -> MaskSpec:
    """Validates the user's mask keywords (ValueError naming the argument) into a MaskSpec. A
    window side longer than MAX_WINDOW is held as MAX_WINDOW: it allows the same keys."""
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool):
            window = (int(sliding_window), int(sliding_window))
        elif (isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2
              and all(isinstance(w, (int, np.integer)) for w in sliding_window)):
            window = (int(sliding_window[0]), int(sliding_window[1]))
        else:
            raise ValueError(f"sliding_window={sliding_window!r} must be an int w or a pair "
                             "(left, right) of ints")
        if min(window) < 0:
            raise ValueError(f"sliding_window={sliding_window!r} must be non-negative")
        window = (min(window[0], MAX_WINDOW), min(window[1], MAX_WINDOW))  # (the same keys)
    if chunk_size is not None:
        if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
        chunk_size = min(int(chunk_size), MAX_WINDOW)  # (one chunk holds every position)
    return MaskSpec(bool(causal), window, chunk_size)


def default_block_size(shard_len: int, layout: str = "contiguous") -> int:
    """The block used when none is given (and by layout='auto'): 512, 256 or 128 dividing L; for
    zigzag, dividing L / 2, and for striped, dividing the stripe, where one does. A block across
    two pieces of a shard (zigzag's halves from opposite ends of the sequence, two stripes) is
    computed whole: at L = 512 a 512 block makes every zigzag causal block partial and none
    skippable (bench_ring on CPU, S=2048, sp=4: zigzag took 1.4-2.3x contiguous's time at block
    512, 0.6-1.15x at 256)."""
    for length in (layout_lib.piece_length(layout, shard_len), shard_len):
        for b in (512, 256, 128):
            if length % b == 0:
                return b
    return shard_len
