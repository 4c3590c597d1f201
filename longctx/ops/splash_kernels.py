"""The Pallas TPU attention kernels the ring drives: splash attention's, made for a ring step.

The kernel bodies follow JAX's splash attention (jax.experimental.pallas.ops.tpu.splash_attention):
the same grids walking a table of live blocks per q-block row (forward) or kv-block column
(backward), the same online softmax, the same block fetching at `data_next` so that a skipped
block is never fetched either. What differs, each for a reason measured on a v5e chip (see
docs/tpu_kernels.md):

  - Masks from positions. A block's mask is computed in the kernel from each query's allowed
    key interval [lo, hi] and each key's global position (ops/masks.MaskSpec.bounds), and from
    segment ids with documents, so any mask of ops/masks.py under any layout needs no table of
    partial-block patterns. Which blocks skip the mask's work (a block the tables mark full has
    no element to mask), each as measured on a v5e (blocks of 2,048, scoped VMEM raised,
    forward + backward unless named):
      - The backward runs a full block unmasked, its sub-tiles unrolled, and a partial one
        masked in a rolled loop over its sub-tiles: 51.2 to 50.2 ms at 32K causal, 189.4 to
        185.0 ms at 64K (82.5% to 84.5% of peak). Both copies unrolled instead doubled the
        code, and took the backward from 33 to 74 ms at 32K. Without segment ids the rolled
        loop walks (keys, queries) sub-tile pairs and skips a pair that no query of it may
        see (the masked half of a causal diagonal block); with dQ added where it is
        computed (`_DqAccumulator.add`), 50.2 to 48.6 ms at 32K causal, 185.0 to 181.0 ms
        at 64K (86.3% of peak).
      - The forward has one body, a full block's mask or'ed to all-true, as splash does: the
        same split there took the forward from 16.4 to 17.3 ms at 32K causal, and was no
        better with the partial blocks rolled.
      - With documents and positions the backward keeps one body too, the full block folded
        into the counts of `_mask`. The forward with documents runs a full block (one document
        fills it whole) as an unmasked copy, skipping the segment compare: 19.9 to 18.3 ms for
        a row that one document fills at 32K, no other row moving.
    Logits stay natural: a base-2 exponent (queries scaled by log2(e), tokamax's default) took
    the forward of full attention from 28.8 to 28.0 ms at 32K but causal's from 16.3 to 17.1,
    and adds a rounding of the queries where the softmax scale is a power of two.
  - One fused backward pass over every kv block, dQ accumulated in place. Splash's fused
    backward writes a dQ per kv block ([kv blocks, heads, L, head_dim]) and sums them after.
    Here each live (kv block, q block) step reads the q block's float32 dQ from HBM, adds its
    sub-tiles' shares and writes it back, with asynchronous copies into three buffers in turn,
    each read started by the step before, ordered so that no read can pass a write to the same
    block (`_DqAccumulator`). The backward's traffic and memory then follow the live blocks, as
    the forward's do, and at 131,072 tokens (or 65,536 with 32 query heads) it fits a v5e's
    HBM where splash's per-kv-block dQ does not. A read started a step early is what brings
    full attention level with splash: at 32K on a v5e, forward + backward, 88.2 ms against
    91.7 with each read started in its own step (stock splash 89.8, tokamax 88.9).
  - Results in float32: a ring step's out, dQ, dK and dV are partials that the ring sums over
    steps, so each is rounded to the input dtype once, at the end, as on one device.
  - The grid's table axis is sized at run time: it ends at the last live entry of the busiest
    row (column), since with documents most entries are dead (`table_grid_size`); the forward's
    grid also ends after the last q block with a live block (its `q_blocks`).
  - A leading batch axis in the grid, with tables shared by every row or one per row.
  - The scoped VMEM limit set from the chip's VMEM (`vmem_limit_bytes`), so that blocks of
    2,048 compile, and a block that no limit fits refused before compiling (`check_vmem`).

Operands are heads-major, one batch row per leading index: q, do [b, heads, L, head_dim]; k, v
[b, kv_heads, L_kv, head_dim] (query head h reads kv head h // (heads / kv_heads): GQA).
Tables (ops/tables.py): data_next and block_mask int32 [1 or b, 1 or heads, rows, width], 0 an
entry that computes and fetches nothing, 1 a partial block, 2 a full one.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
EMPTY, PARTIAL, FULL = 0, 1, 2  # block_mask values


@dataclasses.dataclass(frozen=True)
class Masking:
    """Which element masks a call applies to its partial blocks: positions (q_lo, q_hi against
    kv_positions) for a static mask, segment ids for documents."""
    positions: bool
    segments: bool


def table_grid_size(block_mask, axis: int):
    """How many table entries the grid walks: up to the last live entry of any row (axis=-1:
    the forward) or column (axis=-2: the backward, and the forward's rows), at least 1; an int32
    known at run time."""
    live = block_mask != EMPTY
    position = lax.broadcasted_iota(jnp.int32, live.shape, live.ndim + axis) + 1
    return jnp.maximum(jnp.max(jnp.where(live, position, 0)), 1)


def _table_entry(tables, b, h, i, j):
    """(data_next, block class) of grid entry (i, j) of batch row b, head h, from the
    scalar-prefetch refs; tables shared by every row or head have a leading size of 1."""
    data_next, block_mask = tables[0], tables[1]
    b = 0 if data_next.shape[0] == 1 else b
    h = 0 if data_next.shape[1] == 1 else h
    return data_next[b, h, i, j], block_mask[b, h, i, j]


def _kv_head(h, heads, kv_heads):
    per_kv = heads // kv_heads
    return h if per_kv == 1 else lax.div(h, per_kv)


# ----------------------------------------------------------------------------- VMEM

# Splash's scoped VMEM default; a chip with more VMEM lets a kernel use three quarters of it
# (MaxText's v5e recipes raise the limit to 96 of 128 MiB the same way).
DEFAULT_SCOPED_VMEM = 16 * 2 ** 20


def vmem_limit_bytes(device_kind: str | None) -> int | None:
    """The scoped VMEM a kernel may use on `device_kind` ("TPU v5 lite", ...): 3/4 of the
    chip's VMEM per TensorCore, or None (the compiler's default) for an unknown chip or one no
    larger than the default."""
    if device_kind is None:
        return None
    from jax._src.pallas.mosaic import tpu_info  # lazily: the chip table, TPU-only
    chip = tpu_info.chip_version_from_device_kind(device_kind)
    if chip is None:
        return None
    capacity = tpu_info.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes
    limit = capacity * 3 // 4
    return limit if limit > DEFAULT_SCOPED_VMEM else None


def vmem_bytes(bq: int, bkv: int, bkv_compute: int, head_dim: int, itemsize: int,
               masking: Masking) -> int:
    """An upper estimate of the scoped VMEM the larger of the two kernels takes: its blocks
    double-buffered, its scratch, and the float32 score tiles [bq, bkv_compute] it computes on
    (a handful live at once). Mosaic's own count is what decides; this one is for refusing a
    block before a compile that cannot succeed."""
    tile = bq * bkv_compute * 4
    positions = (2 * bq * LANES + bkv * SUBLANES) * 4 if masking.positions else 0
    segments = (bq * LANES + bkv * SUBLANES) * 4 if masking.segments else 0
    forward = (2 * (bq + 2 * bkv) * head_dim * itemsize            # q, k, v
               + 2 * (bq * head_dim + bq * LANES) * 4              # out, lse
               + (2 * bq * LANES + bq * head_dim) * 4              # m, l, acc
               + 2 * (positions + segments) + 5 * tile)
    backward = (2 * (2 * bq + 2 * bkv) * head_dim * itemsize       # q, do, k, v
                + 2 * 2 * SUBLANES * bq * 4                         # lse, di
                + 2 * 2 * bkv * head_dim * 4                        # dk, dv
                + 2 * bkv * head_dim * 4                            # dk, dv scratch
                + _DqAccumulator.SLOTS * bq * head_dim * 4          # dq buffers
                + 2 * (positions + segments) * bkv // max(bq, 1) + 6 * tile)
    return max(forward, backward)


def check_vmem(bq: int, bkv: int, bkv_compute: int, head_dim: int, itemsize: int,
               masking: Masking, device_kind: str | None) -> None:
    """ValueError, one sentence, when the kernels' blocks cannot fit the chip's VMEM."""
    limit = vmem_limit_bytes(device_kind) or DEFAULT_SCOPED_VMEM
    need = vmem_bytes(bq, bkv, bkv_compute, head_dim, itemsize, masking)
    if need > limit:
        raise ValueError(
            f"attention blocks of {bq} x {bkv} (computed {bkv_compute} keys at a time, head_dim "
            f"{head_dim}) need about {need / 2 ** 20:.0f} MiB of VMEM, more than the "
            f"{limit / 2 ** 20:.0f} MiB a kernel may use on {device_kind or 'this chip'}: use "
            "a smaller attention.block_size")


def _compiler_params(semantics, device_kind):
    limit = vmem_limit_bytes(device_kind)
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                **({} if limit is None else {"vmem_limit_bytes": limit}))


# ----------------------------------------------------------------------------- element masks

def _mask(q_lo, q_hi, kv_pos, q_seg, kv_seg, shape, counts=None, full=None):
    """bool `shape`: which scores of a partial block are allowed. Each argument is a block
    already broadcast to `shape` or None.

    With `counts` (`_interval_counts` of q_lo, q_hi; q_hi unused) the position test is one
    unsigned compare, kv_pos - q_lo < count, and `full` (the block is full) is or'ed into the
    segment test: with segment ids that took a row one document fills from 56.6 to 53.4 ms
    fwd+bwd at 32K on a v5e (blocks of 2,048), while without them it made causal slower
    (51.2 to 52.0 ms), so positions alone keep two compares."""
    if counts is not None:
        within = _u32(kv_pos - q_lo) < counts
        same = q_seg == kv_seg if full is None else (q_seg == kv_seg) | full
        return within & same
    allowed = None
    for term in ((None if kv_pos is None else (kv_pos >= q_lo) & (kv_pos <= q_hi)),
                 (None if kv_seg is None else q_seg == kv_seg)):
        if term is not None:
            allowed = term if allowed is None else allowed & term
    assert allowed is None or allowed.shape == shape
    return allowed


def _u32(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def _interval_counts(lo, hi, full):
    """uint32: how many keys from lo each interval [lo, hi] allows (lo > hi: none); where
    `full`, 2**32 - 1, which passes every key of a full block (they lie in [lo, hi]). The int32
    difference wraps to the exact count for positions above -2**31 (the ring's stay within
    +-2**30, MaskSpec.bounds)."""
    count = jnp.where(hi >= lo, _u32(hi - lo + 1), jnp.uint32(0))
    return jnp.where(full, jnp.uint32(2 ** 32 - 1), count)


def _lanes(x, width):
    """A block whose lanes repeat one value per row ([rows, LANES]) widened (or narrowed) to
    `width` lanes."""
    return jnp.tile(x, (1, pl.cdiv(width, LANES)))[:, :width]


def _slice(index, size):
    """The `index`-th sub-tile of `size` rows or columns of a block."""
    return pl.ds(pl.multiple_of(index * size, size), size)


def _soft_cap(s, soft_cap):
    return s if soft_cap is None else jnp.tanh(s / soft_cap) * soft_cap


# ----------------------------------------------------------------------------- forward
# Grid (batch row b, query head h, table row i, table column j): each q block visits its live
# K/V blocks. Table row i is q block q_blocks[b, i]: the rows with a live block first.

def _forward_kernel(data_next, block_mask, grid_width, q_blocks, q_ref, k_ref, v_ref, q_lo_ref,
                    q_hi_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, sinks_ref, o_ref, lse_ref,
                    m_ref, l_ref, acc_ref, *, bkv_compute, mask_value, soft_cap):
    del q_blocks  # read by the block specs only
    b, h, i, j = (pl.program_id(a) for a in range(4))
    bq, head_dim = acc_ref.shape
    _, cls = _table_entry((data_next, block_mask), b, h, i, j)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if sinks_ref is None:
            m_ref[...] = jnp.full_like(m_ref, mask_value)
            l_ref[...] = jnp.zeros_like(l_ref)
        else:  # the sink is the row's first logit, with no value: exp(sink - max) = 1
            m_ref[...] = sinks_ref[0, h] * jnp.ones_like(m_ref)
            l_ref[...] = jnp.ones_like(l_ref)

    masking = any(r is not None for r in (kv_pos_ref, kv_seg_ref))

    def visit(masked):
        # Only partial blocks run masked when there are segment ids: no full one to fold in.
        counts = (_interval_counts(q_lo_ref[...], q_hi_ref[...], False)
                  if masked and kv_seg_ref is not None and kv_pos_ref is not None else None)

        def body(c, _):
            keys = pl.ds(c * bkv_compute, bkv_compute)
            s = lax.dot_general(q_ref[...], k_ref[keys, :], NT, preferred_element_type=jnp.float32)
            s = _soft_cap(s, soft_cap)
            if masked:
                shape = s.shape
                row = lambda r: None if r is None else _lanes(r[...], bkv_compute)  # noqa: E731
                col = lambda r: None if r is None else jnp.broadcast_to(r[:1, keys], shape)  # noqa: E731
                allowed = _mask(row(q_lo_ref), row(q_hi_ref), col(kv_pos_ref), row(q_seg_ref),
                                col(kv_seg_ref), shape,
                                counts=None if counts is None else _lanes(counts, bkv_compute))
                if kv_seg_ref is None:  # one body for every block: a full one's mask or'ed away
                    allowed = allowed | (cls == FULL)
                s = jnp.where(allowed, s, mask_value)
            m_prev, l_prev = m_ref[...], l_ref[...]                      # [bq, LANES]
            m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            p = jnp.exp(s - _lanes(m_next, bkv_compute))
            alpha = jnp.exp(m_prev - m_next)
            l_ref[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
            m_ref[...] = m_next
            # P stays float32 here, as splash's forward has it: rounded to bf16 for the MXU the
            # ring's bf16 output was 1.4x less accurate (test_splash_kernels), for 2-3% of the
            # forward's time on a v5e.
            pv = lax.dot_general(p, v_ref[keys, :].astype(jnp.float32), NN,
                                 preferred_element_type=jnp.float32)
            acc_ref[...] = _lanes(alpha, head_dim) * acc_ref[...] + pv

        lax.fori_loop(0, k_ref.shape[0] // bkv_compute, body, None, unroll=True)

    if kv_seg_ref is None:  # one body: a full block's mask is or'ed away (module docstring)
        pl.when(cls != EMPTY)(lambda: visit(masking))
    else:  # documents: a block one document fills whole skips the mask's work
        pl.when(cls == FULL)(lambda: visit(False))
        pl.when(cls == PARTIAL)(lambda: visit(True))

    @pl.when(j == grid_width[0] - 1)
    def _end():
        l = l_ref[...]
        o_ref[...] = (acc_ref[...] * _lanes(1.0 / l, head_dim)).astype(o_ref.dtype)
        lse_ref[...] = jnp.log(l) + m_ref[...]


def forward(tables, q_blocks, q, k, v, q_lo, q_hi, kv_pos, q_seg, kv_seg, sinks=None, *, bq,
            bkv, bkv_compute, mask_value, soft_cap, interpret, device_kind=None):
    """(out [b, heads, L, head_dim], lse [b, heads, L]), float32, of q against the live blocks
    of k, v.

    tables: (data_next, block_mask) packed per q-block row, the rows with a live block first;
    q_blocks int32 [1 or b, rows]: the q block of each table row. The grid ends after the last
    row with a live block: a q block with nothing to compute is never written (undefined: the
    caller masks it), nor is a row all of whose keys are masked out (lse ~ mask_value).
    q_lo, q_hi int32 [L] (or None): each query's allowed global key positions; kv_pos int32
    [L_kv]: the keys' global positions (in a per-row layout [b, L] and [b, L_kv], each row its
    own, as the segment ids); q_seg [b, L], kv_seg [b, L_kv] int32 or None. sinks [heads]
    float32 or None: each head's sink logit, in the denominator of every row (as splash's
    forward takes it, so that the output is one division by a sum of the kernel's own
    exponentials: added afterwards from lse, it was 150x less accurate in float32 on a v5e)."""
    data_next, block_mask = tables
    batch, heads, L, head_dim = q.shape
    kv_heads = k.shape[1]
    width = table_grid_size(block_mask, axis=-1)
    height = table_grid_size(block_mask, axis=-2)
    per_row = lambda b: 0 if q_blocks.shape[0] == 1 else b  # noqa: E731

    def q_block(b, i, q_blocks):
        return q_blocks[per_row(b), i]

    def kv_block(b, h, i, j, dn, bm):
        return _table_entry((dn, bm), b, h, i, j)[0]

    q_map = lambda b, h, i, j, dn, bm, w, qb: (b, h, q_block(b, i, qb), 0)  # noqa: E731
    kv_map = lambda b, h, i, j, dn, bm, w, qb: (  # noqa: E731
        b, _kv_head(h, heads, kv_heads), kv_block(b, h, i, j, dn, bm), 0)
    row_spec = lambda: pl.BlockSpec((bq, LANES), lambda b, h, i, j, dn, bm, w, qb: (  # noqa: E731
        q_block(b, i, qb), 0))
    col_spec = lambda: pl.BlockSpec((SUBLANES, bkv), lambda b, h, i, j, dn, bm, w, qb: (  # noqa: E731
        0, kv_block(b, h, i, j, dn, bm)))
    seg_row = lambda: pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, dn, bm, w, qb: (  # noqa: E731
        b, q_block(b, i, qb), 0))
    seg_col = lambda: pl.BlockSpec((None, SUBLANES, bkv), lambda b, h, i, j, dn, bm, w, qb: (  # noqa: E731
        b, 0, kv_block(b, h, i, j, dn, bm)))
    positions = q_lo is not None
    segments = q_seg is not None
    if positions and q_lo.ndim == 2:  # a per-row layout: every row its own positions
        row_spec, col_spec = seg_row, seg_col
    in_specs = [pl.BlockSpec((None, None, bq, head_dim), q_map),
                pl.BlockSpec((None, None, bkv, head_dim), kv_map),
                pl.BlockSpec((None, None, bkv, head_dim), kv_map),
                row_spec() if positions else None, row_spec() if positions else None,
                col_spec() if positions else None,
                seg_row() if segments else None, seg_col() if segments else None,
                None if sinks is None else pl.BlockSpec(
                    (SUBLANES, heads), lambda *_: (0, 0), memory_space=pltpu.SMEM)]
    args = [q, k, v,
            _rows(q_lo) if positions else None, _rows(q_hi) if positions else None,
            _cols(kv_pos) if positions else None,
            _rows(q_seg) if segments else None, _cols(kv_seg) if segments else None,
            None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32),
                                                        (SUBLANES, heads))]
    out_specs = [pl.BlockSpec((None, None, bq, head_dim), q_map),
                 pl.BlockSpec((None, None, bq, LANES), q_map)]
    kernel = functools.partial(_forward_kernel, bkv_compute=bkv_compute, mask_value=mask_value,
                               soft_cap=soft_cap)
    with jax.named_scope("longctx_attention_fwd"):
        out, lse = pl.pallas_call(
            kernel, name="longctx_attention_fwd", interpret=interpret,
            out_shape=[jax.ShapeDtypeStruct((batch, heads, L, head_dim), jnp.float32),
                       jax.ShapeDtypeStruct((batch, heads, L, LANES), jnp.float32)],
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=4, in_specs=in_specs, out_specs=out_specs,
                grid=(batch, heads, height, width),
                scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                                pltpu.VMEM((bq, LANES), jnp.float32),
                                pltpu.VMEM((bq, head_dim), jnp.float32)]),
            compiler_params=_compiler_params(("parallel", "parallel", "arbitrary", "arbitrary"),
                                             device_kind),
        )(data_next, block_mask, jnp.reshape(width, (1,)), q_blocks, *args)
    return out, lse[..., 0]


def _rows(x):
    """[..., L] -> [..., L, LANES]: one value per row, repeated across the lanes (a query-side
    block of the forward, a key-side block of the backward)."""
    return lax.broadcast_in_dim(x, (*x.shape, LANES), tuple(range(x.ndim)))


def _cols(x):
    """[..., L] -> [..., SUBLANES, L]: one value per column, repeated down the sublanes."""
    return lax.broadcast_in_dim(x, (*x.shape[:-1], SUBLANES, x.shape[-1]),
                                tuple(range(x.ndim - 1)) + (x.ndim,))


# ----------------------------------------------------------------------------- backward
# Grid (batch row b, kv block j, query head h, table row i): each kv block visits its live q
# blocks; dK and dV accumulate over the query heads of its kv head and their q blocks, in VMEM;
# dQ accumulates over kv blocks, in HBM.

class _DqAccumulator:
    """dQ[b, h, q block] += a block's share, in HBM, from inside the backward's grid.

    A live step reads its q block's float32 dQ into one of three VMEM buffers (in turn), adds
    each sub-tile's share into it as it is computed (the first add waits for the read) and
    starts writing it back; nothing waits for the write until its buffer comes round again.
    The read is started by the grid step before, live or dead, at its end (`start_read`):
    Mosaic's scheduler moves a DMA start down to the first wait for it, so a read started in
    its own step stalls that step for the whole copy (in the v5e schedule of full attention at
    32K, the start 79 bundles before the wait, the first sub-tile's matmuls before both). Only
    the grid's first step reads for itself. No read starts while a write to the same block may
    be in flight: before a read into a buffer, every pending write of that buffer or to that
    block is waited for (the step before's own, when both steps hold one block). Three
    buffers, so that the one a live step reads the next step's block into was written two
    live steps before, long landed (with two, it would be the write it had just started).

    State in SMEM across grid steps: the live-step count, and per buffer the address of the
    block its pending write goes to (b, head, q block as one int; -1 with none)."""

    SLOTS = 3
    _COUNT = 0    # state[_COUNT]: live steps so far
    _WRITING = 1  # state[_WRITING + slot]: the address its pending write goes to
    STATE = _WRITING + SLOTS
    _NONE = -1

    def __init__(self, dq_hbm, buffers, semaphores, state):
        self.dq, self.buffers, self.sems, self.state = dq_hbm, buffers, semaphores, state
        self.bq = buffers.shape[1]

    def _writing(self, slot):
        return self.state[self._WRITING + slot]

    def _address(self, b, h, block):
        heads, q_blocks = self.dq.shape[1], self.dq.shape[2] // self.bq
        return (b * heads + h) * q_blocks + block

    def _write(self, slot, b, h, block):
        return pltpu.make_async_copy(self.buffers.at[slot],
                                     self.dq.at[b, h, pl.ds(block * self.bq, self.bq)],
                                     self.sems.at[1, slot])

    def _read(self, slot, b, h, block):
        return pltpu.make_async_copy(self.dq.at[b, h, pl.ds(block * self.bq, self.bq)],
                                     self.buffers.at[slot], self.sems.at[0, slot])

    def _wait_write_if(self, slot, condition):
        @pl.when(condition & (self._writing(slot) != self._NONE))
        def _():
            self._write(slot, 0, 0, 0).wait()
            self.state[self._WRITING + slot] = self._NONE

    def wait_read(self, slot):
        """Waits for the step's read: once a step, before its first add (or, when a step skips
        its first sub-tile, in its place)."""
        self._read(slot, 0, 0, 0).wait()

    def reset(self):
        self.state[self._COUNT] = 0
        for slot in range(self.SLOTS):
            self.state[self._WRITING + slot] = self._NONE

    def slot(self):
        """The buffer of the current live step (of the next one, once this one finished)."""
        return lax.rem(self.state[self._COUNT], self.SLOTS)

    def start_read(self, b, h, block):
        """Starts reading the block of the next live step into its buffer, after every write
        that could land later: the write of that buffer and any to that block."""
        slot, address = self.slot(), self._address(b, h, block)
        for other in range(self.SLOTS):
            self._wait_write_if(other, (other == slot) | (self._writing(other) == address))
        self._read(slot, b, h, block).start()

    def add(self, slot, rows, share, first):
        """The step's block, rows `rows` (a pl.ds), += share; `first`: the step's first add,
        which waits for the read. A condition the compiler knows (the unrolled loop's first
        sub-tile) rather than a flag in SMEM: a flag tested at every add took full attention's
        forward + backward from 91.6 to 92.7 ms at 32K on a v5e, and documents' up 2%."""
        pl.when(first)(lambda: self.wait_read(slot))
        self.buffers[slot, rows, :] = self.buffers[slot, rows, :] + share

    def finish(self, slot, b, h, block):
        """Ends a live step: its block, every share added, goes back to HBM."""
        self._write(slot, b, h, block).start()
        self.state[self._WRITING + slot] = self._address(b, h, block)
        self.state[self._COUNT] = self.state[self._COUNT] + 1

    def drain(self):
        """Waits for every write still in flight (at the grid's last step)."""
        for slot in range(self.SLOTS):
            self._wait_write_if(slot, True)


def _next_grid_step(b, j, h, i, n_b, n_j, n_h, height):
    """(exists, b, j, h, i): the backward's grid index after (b, j, h, i), in the grid's order
    (the table entry i fastest, then the head, the kv block, the batch row); clamped in range
    where there is none."""
    i1 = i + 1
    h1, i1 = jnp.where(i1 == height, h + 1, h), jnp.where(i1 == height, 0, i1)
    j1, h1 = jnp.where(h1 == n_h, j + 1, j), jnp.where(h1 == n_h, 0, h1)
    b1, j1 = jnp.where(j1 == n_j, b + 1, b), jnp.where(j1 == n_j, 0, j1)
    return b1 < n_b, jnp.minimum(b1, n_b - 1), j1, h1, i1


def _backward_kernel(data_next, block_mask, grid_height, q_ref, k_ref, v_ref, q_lo_ref,
                     q_hi_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, lse_ref, do_ref, di_ref,
                     dq_in, dq_hbm, dk_ref, dv_ref, dk_acc, dv_acc, dq_buffers, semaphores,
                     state, *, heads, kv_heads, bkv_compute, mask_value, soft_cap):
    del dq_in  # the same buffer as dq_hbm (aliased): zeros, which the live steps add into
    b, j, h, i = (pl.program_id(a) for a in range(4))
    n_b, n_j, n_h = (pl.num_programs(a) for a in range(3))
    bq, bkv = q_ref.shape[0], k_ref.shape[0]
    dq = _DqAccumulator(dq_hbm, dq_buffers, semaphores, state)
    block, cls = _table_entry((data_next, block_mask), b, h, i, j)
    per_kv = heads // kv_heads
    first_of_group = (i == 0) & (lax.rem(h, per_kv) == 0)
    last_of_group = (i == grid_height[0] - 1) & (lax.rem(h, per_kv) == per_kv - 1)

    @pl.when((b == 0) & (j == 0) & (h == 0) & (i == 0))
    def _():
        dq.reset()
        pl.when(cls != EMPTY)(lambda: dq.start_read(b, h, block))

    @pl.when(first_of_group)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    @pl.when(cls != EMPTY)
    def _visit():
        slot = dq.slot()
        counts = (_interval_counts(q_lo_ref[:1, :], q_hi_ref[:1, :], cls == FULL)
                  if kv_seg_ref is not None and kv_pos_ref is not None else None)

        def tile(keys, queries, masked, first):
            """The gradients' share of keys x queries (pl.ds slices of the block); `first`:
            the step's first tile."""
            k, v = k_ref[keys, :], v_ref[keys, :]
            q, do = q_ref[queries, :], do_ref[queries, :]
            s_raw = lax.dot_general(k, q, NT, preferred_element_type=jnp.float32)  # [kc, qc]
            s = _soft_cap(s_raw, soft_cap)
            if masked:
                shape = s.shape
                row = lambda r: None if r is None else jnp.broadcast_to(  # noqa: E731
                    r[:1, queries], shape)
                col = lambda r: None if r is None else _lanes(r[keys, :], shape[1])  # noqa: E731
                if counts is None:  # a partial block (full ones run unmasked, below)
                    allowed = _mask(row(q_lo_ref), row(q_hi_ref), col(kv_pos_ref),
                                    row(q_seg_ref), col(kv_seg_ref), shape)
                else:  # every query at once: the full block or'ed into the counts and segments
                    allowed = _mask(row(q_lo_ref), None, col(kv_pos_ref), row(q_seg_ref),
                                    col(kv_seg_ref), shape,
                                    counts=jnp.broadcast_to(counts, shape), full=cls == FULL)
                s = jnp.where(allowed, s, mask_value)
            p = jnp.exp(s - lse_ref[:1, queries])
            dv_acc[keys, :] += lax.dot_general(p.astype(do.dtype), do, NN,
                                               preferred_element_type=jnp.float32)
            dp = lax.dot_general(v, do, NT, preferred_element_type=jnp.float32)
            ds = (dp - di_ref[:1, queries]) * p
            if soft_cap is not None:
                t = jnp.tanh(s_raw / soft_cap)
                ds = ds * (1 - t * t)
            ds = ds.astype(q.dtype)
            dk_acc[keys, :] += lax.dot_general(ds, q, NN, preferred_element_type=jnp.float32)
            dq.add(slot, queries, lax.dot_general(ds.T, k, NN, preferred_element_type=jnp.float32),
                   first)

        sub_tiles = bkv // bkv_compute
        every_query = pl.ds(0, bq)

        def sub_tile(c, masked):
            tile(_slice(c, bkv_compute), every_query, masked, first=c == 0)

        def whole(masked):  # the block's sub-tiles unrolled
            lax.fori_loop(0, sub_tiles, lambda c, _: sub_tile(c, masked), None, unroll=True)

        def partial_block():  # rolled
            if kv_pos_ref is None:  # documents of a full mask: the sub-tiles, every query
                lax.fori_loop(0, sub_tiles, lambda c, _: sub_tile(c, True), None)
                return
            # (keys, queries) sub-tile pairs, a pair whose keys lie outside every one of its
            # queries' intervals skipped: the masked half of a causal diagonal block, 6 of its
            # 16 pairs at 2,048.
            bq_compute = bkv_compute if bq % bkv_compute == 0 else bq
            q_tiles = bq // bq_compute

            def pair(t, _):
                c, r = lax.div(t, q_tiles), lax.rem(t, q_tiles)
                keys, queries = _slice(c, bkv_compute), _slice(r, bq_compute)
                positions = kv_pos_ref[keys, :]
                live = ((jnp.max(positions) >= jnp.min(q_lo_ref[:1, queries]))
                        & (jnp.min(positions) <= jnp.max(q_hi_ref[:1, queries])))
                pl.when(live)(lambda: tile(keys, queries, True, first=t == 0))
                pl.when((t == 0) & jnp.logical_not(live))(lambda: dq.wait_read(slot))

            lax.fori_loop(0, sub_tiles * q_tiles, pair, None)

        if counts is None and (kv_pos_ref is not None or kv_seg_ref is not None):  # a mask
            pl.when(cls == FULL)(lambda: whole(False))
            pl.when(cls == PARTIAL)(partial_block)
        else:  # no mask; or documents with positions, one body (module docstring)
            whole(counts is not None)
        dq.finish(slot, b, h, block)

    # The next grid step's read, where that step is live, starts here (_DqAccumulator).
    exists, b1, j1, h1, i1 = _next_grid_step(b, j, h, i, n_b, n_j, n_h, grid_height[0])
    block1, cls1 = _table_entry((data_next, block_mask), b1, h1, i1, j1)

    pl.when(exists & (cls1 != EMPTY))(lambda: dq.start_read(b1, h1, block1))

    @pl.when(last_of_group)
    def _():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    @pl.when((b == n_b - 1) & (j == n_j - 1) & (h == n_h - 1) & (i == grid_height[0] - 1))
    def _():
        dq.drain()


def backward(tables, q, k, v, q_lo, q_hi, kv_pos, q_seg, kv_seg, lse, do, di, *, bq, bkv,
             bkv_compute, mask_value, soft_cap, interpret, device_kind=None,
             dkv_dtype=jnp.float32):
    """One fused pass over the live blocks: (dQ [b, heads, L, head_dim] float32, dK, dV [b,
    kv_heads, L_kv, head_dim] in `dkv_dtype`, summed in float32 and rounded once). tables:
    (data_next, block_mask) packed per kv-block column ([..., rows, kv blocks]); lse, di [b,
    heads, L] float32; the rest as `forward`'s. dQ starts as zeros that the kernel adds into (an
    aliased buffer: an output's HBM is otherwise uninitialised); a q or kv block with no live
    block gets zeros."""
    data_next, block_mask = tables
    batch, heads, L, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    height = table_grid_size(block_mask, axis=-2)

    def q_block(b, j, h, i, dn, bm):
        return _table_entry((dn, bm), b, h, i, j)[0]

    q_map = lambda b, j, h, i, dn, bm, g: (b, h, q_block(b, j, h, i, dn, bm), 0)  # noqa: E731
    kv_map = lambda b, j, h, i, *_: (b, _kv_head(h, heads, kv_heads), j, 0)  # noqa: E731
    stat_map = lambda b, j, h, i, dn, bm, g: (b, h, 0, q_block(b, j, h, i, dn, bm))  # noqa: E731
    q_row = lambda: pl.BlockSpec((SUBLANES, bq), lambda b, j, h, i, dn, bm, g: (  # noqa: E731
        0, q_block(b, j, h, i, dn, bm)))
    kv_col = lambda: pl.BlockSpec((bkv, LANES), lambda b, j, *_: (j, 0))  # noqa: E731
    seg_q = lambda: pl.BlockSpec((None, SUBLANES, bq), lambda b, j, h, i, dn, bm, g: (  # noqa: E731
        b, 0, q_block(b, j, h, i, dn, bm)))
    seg_kv = lambda: pl.BlockSpec((None, bkv, LANES), lambda b, j, *_: (b, j, 0))  # noqa: E731
    positions = q_lo is not None
    segments = q_seg is not None
    if positions and q_lo.ndim == 2:  # a per-row layout: every row its own positions
        q_row, kv_col = seg_q, seg_kv
    stats = lambda x: jnp.broadcast_to(x[:, :, None, :], (batch, heads, SUBLANES, L))  # noqa: E731
    in_specs = [pl.BlockSpec((None, None, bq, head_dim), q_map),
                pl.BlockSpec((None, None, bkv, head_dim), kv_map),
                pl.BlockSpec((None, None, bkv, head_dim), kv_map),
                q_row() if positions else None, q_row() if positions else None,
                kv_col() if positions else None,
                seg_q() if segments else None, seg_kv() if segments else None,
                pl.BlockSpec((None, None, SUBLANES, bq), stat_map),
                pl.BlockSpec((None, None, bq, head_dim), q_map),
                pl.BlockSpec((None, None, SUBLANES, bq), stat_map),
                pl.BlockSpec(memory_space=pl.ANY)]
    args = [q, k, v,
            _cols(q_lo) if positions else None, _cols(q_hi) if positions else None,
            _rows(kv_pos) if positions else None,
            _cols(q_seg) if segments else None, _rows(kv_seg) if segments else None,
            stats(lse), do, stats(di), jnp.zeros(q.shape, jnp.float32)]
    dkv_spec = pl.BlockSpec((None, None, bkv, head_dim), kv_map)
    dq_index = sum(x is not None for x in args[:-1])
    kernel = functools.partial(_backward_kernel, heads=heads, kv_heads=kv_heads,
                               bkv_compute=bkv_compute, mask_value=mask_value, soft_cap=soft_cap)
    with jax.named_scope("longctx_attention_bwd"):
        dq, dk, dv = pl.pallas_call(
            kernel, name="longctx_attention_bwd", interpret=interpret,
            out_shape=[jax.ShapeDtypeStruct(q.shape, jnp.float32),
                       jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dkv_dtype),
                       jax.ShapeDtypeStruct((batch, kv_heads, kv_len, head_dim), dkv_dtype)],
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3, in_specs=in_specs,
                out_specs=[pl.BlockSpec(memory_space=pl.ANY), dkv_spec, dkv_spec],
                grid=(batch, kv_len // bkv, heads, height),
                scratch_shapes=[pltpu.VMEM((bkv, head_dim), jnp.float32),
                                pltpu.VMEM((bkv, head_dim), jnp.float32),
                                pltpu.VMEM((_DqAccumulator.SLOTS, bq, head_dim), jnp.float32),
                                pltpu.SemaphoreType.DMA((2, _DqAccumulator.SLOTS)),
                                pltpu.SMEM((_DqAccumulator.STATE,), jnp.int32)]),
            # Every axis in order: dQ's read-modify-write spans the whole grid, and dK, dV
            # reduce over the heads and q blocks.
            compiler_params=_compiler_params(("arbitrary",) * 4, device_kind),
            input_output_aliases={3 + dq_index: 0},
        )(data_next, block_mask, jnp.reshape(height, (1,)), *args)
    return dq, dk, dv
