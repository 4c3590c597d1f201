"""What the masks mean, and which sequence layout a mask should run in.

Every static mask here (full, causal, sliding window, chunked causal and their AND) is, for a
query at global position i, an interval of allowed key positions [lo(i), hi(i)] (`MaskSpec`).
Documents are data, not a static mask: segment ids (`longctx.ops.tables` turns both into the
ring's block tables). `resolve_layout` picks the layout whose ring finishes first for a mask.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from longctx import layout as layout_lib

# "Unbounded" interval ends: positions are < 2**62 on the host (int64) and < 2**30 on device
# (int32, where lo - position and position - hi must not overflow).
_BIG = np.int64(2) ** 62
_BIG_ON_DEVICE = 2 ** 30


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """AND of the mask terms, in global positions. window = (left, right): j in [i-left, i+right]."""
    causal: bool = False
    window: tuple[int, int] | None = None
    chunk: int | None = None

    def bounds(self, pos):
        """Allowed key interval [lo, hi] (inclusive) for queries at global positions `pos`:
        int64 numpy for host positions, int32 jax for positions computed on device. Both ends
        are non-decreasing in the position (ops/tables.py relies on it)."""
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


def document_chunk_ids(segment_ids, chunk: int, positions=None) -> np.ndarray:
    """The host's twin of the ring's per-document chunk ids (ring._kernel_segment_ids) for
    natural-order rows [rows, S]: 1 + the column where each token's chunk starts, column minus
    (in-document position mod chunk); padding (id <= 0) kept. `positions` default to the
    in-document ones (0, 1, ... restarting wherever the id changes, as data.packing packs rows).
    With these ids and `within_chunk_window`, the tables see what the ring computes."""
    ids = np.asarray(segment_ids, np.int64)
    col = np.broadcast_to(np.arange(ids.shape[-1]), ids.shape)
    if positions is None:
        starts = np.ones(ids.shape, bool)
        starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
        positions = col - np.maximum.accumulate(np.where(starts, col, 0), axis=-1)
    chunk_start = col - np.asarray(positions, np.int64) % chunk + 1
    return np.where(ids > 0, chunk_start, ids).astype(np.int32)


def make_mask_spec(causal=False, sliding_window=None, chunk_size=None) -> MaskSpec:
    """Validates the user's mask keywords (ValueError naming the argument) into a MaskSpec."""
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
    if chunk_size is not None:
        if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
        chunk_size = int(chunk_size)
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


def resolve_layout(layout: str, seq_len: int, num_shards: int, *, causal=False,
                   sliding_window=None, chunk_size=None, block_size: int | None = None,
                   segment_ids=None) -> str:
    """Concrete layout name; "auto" picks the layout whose ring finishes first for the mask, and
    with `segment_ids` for the mask on those rows of packed documents.

    "Finishes first" = the smallest critical path, sum over run steps of max over devices of
    computed blocks (the denominator of the efficiency), plus one block per run step, counted in
    (query, key) pairs. For a fixed mask the useful work is the same in every layout up to block
    rounding, so this is the highest efficiency measured in useful work; it also stops a
    perfectly balanced but wasteful layout from winning. The block per step is what a step costs
    beyond its blocks (its K/V's first block arrives before any compute hides the transfer, and
    its output is merged): it decides between layouts whose paths are level, such as striped and
    contiguous under a 4,096-token window at 128K tokens on 8 devices (287 and 288 blocks, on 8
    ring steps against 2). Ties: higher efficiency, fewer steps, then the order of
    `layout.LAYOUTS`.

    Each layout is scored with `block_size`, the block the ring will run, when the caller knows
    it (train.resolve_layout: attention.block_size; the pipeline and the model are both given the
    result), else with its `default_block_size`: what ring_attention(layout="auto") does, so that
    a data pipeline resolving "auto" without knowing the block agrees with it.

    `segment_ids` (natural-order [rows, S], 0 = padding; e.g. data.pipeline.layout_sample's):
    each layout is scored on what its ring computes on those rows (tables.document_schedule):
    the critical path over the steps that run plus one block per step the ring goes through, and
    fewer blocks in all on ties. Documents change the answer: the static choice balances the
    causal triangle, but packed documents keep only bands along the diagonal, which a layout that
    stripes the row balances better (on 8 rows of the embedded corpus at 131,072 tokens, sp=8,
    block 512, causal: critical path 29,552 blocks contiguous, 21,807 zigzag, 15,784 striped).
    """
    from longctx.ops import tables  # (the tables are built from this module's MaskSpec)

    if layout != "auto":
        layout_lib.permutation(layout, seq_len, num_shards)
        return layout
    best, best_key = None, None
    for rank, name in enumerate(layout_lib.LAYOUTS):
        try:
            layout_lib.permutation(name, seq_len, num_shards)
        except ValueError:
            continue  # e.g. zigzag needs seq_len divisible by 2*sp
        block = block_size or default_block_size(seq_len // num_shards, name)
        # In (query, key) pairs: the layouts' default blocks can differ (zigzag's is smaller).
        if segment_ids is None:
            sched = tables.ring_schedule(seq_len, num_shards, block, name, causal, sliding_window,
                                         chunk_size)
            key = ((sched.critical_path + sched.steps) * block * block,
                   -round(sched.efficiency, 9), sched.steps, rank)
        else:
            spec = make_mask_spec(causal, sliding_window, chunk_size)
            docs = tables.document_schedule(spec, name, seq_len, num_shards, block, segment_ids,
                                            count_kept=False)
            steps = len(docs.visited_steps)
            key = ((docs.critical_path + steps) * block * block,
                   int(docs.computed_blocks.sum()) * block * block, steps, rank)
        if best_key is None or key < best_key:
            best, best_key = name, key
    if best is None:
        raise ValueError(f"seq_len={seq_len} is not divisible by num_shards={num_shards}")
    return best
