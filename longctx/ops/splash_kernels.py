"""Splash's Pallas kernels in pallas_calls of our own, whose results are float32.

Splash's wrappers (`_splash_attention_forward`, `_splash_attention_bwd_dq`, `_bwd_dkv`) declare
out, dq, dk and dv in the input dtype. That suits one call over a whole sequence, which rounds
once. A ring step's results are partials that the ring sums in float32 over sp steps: rounded
to bf16 first, a result carries a rounding per step besides its final one (so rounded, out's mean
error is 1.04-1.54x single-device splash's at bf16, S=4096, sp=4; benchmarks/bench_bf16_error.py).
The kernel bodies already compute in float32 and cast only when they store
(`o_ref[...] = x.astype(o_ref.dtype)`), so declaring float32 results is the whole change: the
kernels are splash's, unmodified, and the block specs below are splash's, specialised to the
one configuration the ring uses:
  - operands heads-major, [heads, L, head_dim] (splash's HEAD_DIM_MINOR), one batch row;
  - multi-head K/V, query head h reading kv head h // (heads / kv_heads) (GQA);
  - a MaskInfo from ops/tables.py: data_next, block_mask and mask_next always present, partial
    blocks optional, no q_sequence; no mask_function; no sinks (the ring merges them once).
As in splash, each K/V block (forward, dq) or Q block (dkv) is fetched at `data_next`, the block
the table says comes next, so a block that is skipped is never fetched either. Unlike splash's,
the grid's table axis is sized at run time: it ends at the last live entry of the busiest row
(column) of the step's tables (`table_grid_size`), since with documents most entries are dead;
and the forward's grid ends after the last q block with a live block (`forward`'s q_blocks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

LANES, SUBLANES = sk.NUM_LANES, sk.NUM_SUBLANES
_HEAD_MINOR = sk.QKVLayout.HEAD_DIM_MINOR
_LAYOUTS = dict(q_layout=_HEAD_MINOR, k_layout=_HEAD_MINOR, v_layout=_HEAD_MINOR)


def _f32(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _scratch(shape):
    """One block for the whole grid: splash's kernels take their scratch buffers as outputs."""
    return pl.BlockSpec(shape, lambda *_: (0, 0))


def _kv_head(h, heads, kv_heads):
    per_kv = heads // kv_heads
    return h if per_kv == 1 else lax.div(h, per_kv)


def _next(h, i, j, tables, next_i=False):
    """(block to fetch, partial-block index) at grid point (h, i, j): splash's _next_nonzero.
    tables: the scalar-prefetch refs (data_next, block_mask, mask_next, grid size)."""
    data_next, block_mask, mask_next, *_ = tables
    block, mask, *_ = sk._next_nonzero(  # pylint: disable=protected-access
        h, i, j, data_next, block_mask, mask_next, next_i=next_i)
    return block, mask


def _tables(info):
    return info.data_next, info.block_mask, info.mask_next


def table_grid_size(info, axis: int):
    """How many table entries the grid walks: up to the last live entry of any row (axis=-1,
    the forward and dq kernels) or column (axis=-2: dkv; and the forward's rows, packed by
    tables.live_rows_first), at least 1; an int32 known at run time. ops/tables.grid_tables
    packs each row's live entries first, so with documents a ring step's rows are mostly dead
    entries, and each one walked would still cost a grid step (on CPU, the interpreter's block
    copies: about a quarter of a live block's time)."""
    live = info.block_mask != 0
    position = lax.broadcasted_iota(jnp.int32, live.shape, live.ndim + axis) + 1
    return jnp.maximum(jnp.max(jnp.where(live, position, 0)), 1)


class _LastTableStep:
    """Splash's kernels take the grid's size along the table axis as `grid_width` and use it
    only to find that axis's last step (`index == grid_width - 1`, where they store their
    results). For a grid sized at run time this stands in for it: `- 1` reads the size from
    its scalar-prefetch ref. (pl.num_programs would read it from the grid, but under vmap
    jax 0.10.2's interpreter answers with the wrong axis's size.)"""

    def __init__(self, size_ref):
        self.size_ref = size_ref

    def __sub__(self, other):
        return self.size_ref[0] - other


def _call(kernel, name, grid, in_specs, out_specs, out_shapes, semantics, interpret, info, *args,
          q_blocks=None):
    """pallas_call of a splash kernel over `grid`, whose last (table) axis has a size known at
    run time (table_grid_size); the kernel gets it as a fourth scalar-prefetch operand.
    q_blocks (the forward's, optional): a fifth, the q block of each grid row
    (`_Q_BLOCKS`), which the kernel itself never reads: only the block specs do."""
    extra = () if q_blocks is None else (q_blocks,)

    def sized_kernel(data_next, block_mask, mask_next, grid_size, *refs):
        return kernel(data_next, block_mask, mask_next, *refs[len(extra):],
                      grid_width=_LastTableStep(grid_size))

    with jax.named_scope(name):
        return pl.pallas_call(
            sized_kernel, out_shape=out_shapes, name=name, interpret=interpret,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4 + len(extra),
                                                   in_specs=in_specs, out_specs=out_specs,
                                                   grid=grid),
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        )(*_tables(info), jnp.reshape(grid[-1], (1,)), *extra, *args)


_Q_BLOCKS = 4  # where q_blocks is among the scalar-prefetch refs that index maps receive


# ----------------------------------------------------------------------------- forward and dq
# Grid (query head h, table row i, table column j): each q block visits its live K/V blocks.
# Table row i is q block i, or q_blocks[i] where the forward is given them (the rows with a live
# block first, and the grid ends after them).

def _identity_rows(i, *tables):
    return i


def _listed_rows(i, *tables):
    return tables[_Q_BLOCKS][i]


def _row_major_specs(info, q, k, segment_ids, bq, bkv, q_block=_identity_rows):
    """q, k, v, segment-id and partial-block specs and arrays shared by the forward and dq.
    q_block(i, *prefetch refs): the q block of table row i."""
    heads, L, head_dim = q.shape
    kv_heads, kv_len, _ = k.shape

    def kv_map(h, i, j, *tables):
        return _kv_head(h, heads, kv_heads), _next(h, i, j, tables)[0], 0

    q_spec = pl.BlockSpec((None, bq, head_dim), lambda h, i, j, *t: (h, q_block(i, *t), 0))
    kv_spec = pl.BlockSpec((None, bkv, head_dim), kv_map)
    if segment_ids is None:
        seg_specs, seg_arrays = [None, None], [None, None]
    else:
        seg_specs = [pl.BlockSpec((bq, LANES), lambda h, i, j, *t: (q_block(i, *t), 0)),
                     pl.BlockSpec((SUBLANES, bkv),
                                  lambda h, i, j, *tables: (0, _next(h, i, j, tables)[0]))]
        seg_arrays = [lax.broadcast_in_dim(segment_ids.q, (L, LANES), (0,)),
                      lax.broadcast_in_dim(segment_ids.kv, (SUBLANES, kv_len), (1,))]
    mask_spec = None if info.partial_mask_blocks is None else pl.BlockSpec(
        (None, bq, bkv), lambda h, i, j, *tables: (_next(h, i, j, tables)[1], 0, 0))
    return q_spec, kv_spec, seg_specs, seg_arrays, mask_spec


def forward(info, q, k, v, segment_ids, *, bq, bkv, bkv_compute, mask_value, soft_cap, interpret,
            q_blocks=None):
    """Splash's forward kernel: (out [heads, L, head_dim], logsumexp [heads, L]), both float32.

    q_blocks (int32 [q blocks], optional): the q block of each table row, the rows with a live
    block first (ops/tables.live_rows_first), for tables shared by every head. The grid then
    ends after the last of them: a q block with nothing to compute costs no grid step, and its
    out and logsumexp are never written (undefined: the caller masks them). Without it table row
    i is q block i and every q block is walked."""
    heads, L, head_dim = q.shape
    grid_width = table_grid_size(info, axis=-1)
    if q_blocks is None:
        grid_height, q_block = L // bq, _identity_rows
    else:
        assert info.block_mask.shape[0] == 1, "q_blocks is one list for every head"
        grid_height, q_block = table_grid_size(info, axis=-2), _listed_rows
    q_spec, kv_spec, seg_specs, seg_arrays, mask_spec = _row_major_specs(
        info, q, k, segment_ids, bq, bkv, q_block)
    out_map = lambda h, i, j, *t: (h, q_block(i, *t), 0)  # noqa: E731
    kernel = functools.partial(
        sk.flash_attention_kernel, mask_value=mask_value, bq=bq, bkv=bkv,
        bkv_compute=bkv_compute, head_dim_v=head_dim, attn_logits_soft_cap=soft_cap,
        mask_function=None, **_LAYOUTS)
    *_, out, lse = _call(
        kernel, "longctx_splash_fwd", (heads, grid_height, grid_width),
        [q_spec, kv_spec, kv_spec, *seg_specs, None, mask_spec, None],
        [_scratch((bq, LANES)), _scratch((bq, LANES)), _scratch((bq, head_dim)),
         pl.BlockSpec((None, bq, head_dim), out_map),
         pl.BlockSpec((None, bq, LANES), out_map)],
        [_f32((bq, LANES)), _f32((bq, LANES)), _f32((bq, head_dim)), _f32((heads, L, head_dim)),
         _f32((heads, L, LANES))],
        ("parallel", "arbitrary", "arbitrary"), interpret, info,
        q, k, v, *seg_arrays, None, info.partial_mask_blocks, None, q_blocks=q_blocks)
    return out, lse[..., 0]


def backward_dq(info, q, k, v, segment_ids, lse, do, di, *, bq, bkv, mask_value, soft_cap,
                interpret):
    """Splash's dq kernel (the unfused backward): dq [heads, L, head_dim] float32."""
    heads, L, head_dim = q.shape
    grid_width = table_grid_size(info, axis=-1)
    q_spec, kv_spec, seg_specs, seg_arrays, mask_spec = _row_major_specs(
        info, q, k, segment_ids, bq, bkv)
    row_spec = pl.BlockSpec((None, 1, bq), lambda h, i, *_: (h, 0, i))  # lse, di: [heads, 1, L]
    kernel = functools.partial(
        sk._flash_attention_dq_kernel,  # pylint: disable=protected-access
        mask_value=mask_value, bq=bq, bkv=bkv,
        attn_logits_soft_cap=soft_cap, mask_function=None, **_LAYOUTS)
    _, dq = _call(
        kernel, "longctx_splash_dq", (heads, L // bq, grid_width),
        [q_spec, kv_spec, kv_spec, *seg_specs, None, row_spec, q_spec, row_spec, mask_spec, None],
        [_scratch((bq, head_dim)), q_spec],
        [_f32((bq, head_dim)), _f32(q.shape)],
        ("arbitrary", "arbitrary", "arbitrary"), interpret, info,
        q, k, v, *seg_arrays, None, lse[:, None], do, di[:, None], info.partial_mask_blocks, None)
    return dq


# ----------------------------------------------------------------------------- dk, dv (and fused dq)
# Grid (kv block j, query head h, table row i): each kv block visits its live q blocks.

def backward_dkv(info, q, k, v, segment_ids, lse, do, di, *, bq, bkv, bkv_compute, mask_value,
                 soft_cap, fused, interpret):
    """Splash's dkv kernel: (dq, dk, dv), float32. fused: the kernel also computes dq; else dq
    is None.

    The fused kernel is called on one kv block (as the ring calls it: ops/splash.py) and writes
    each grid row's dq straight into the q block that the table fetched there, [heads, L,
    head_dim] with no per-row copy to add up after (at 32,768 tokens per chip for the 8B shape,
    those copies cost 1 GiB of the train step). That asks what packed tables give: within the
    rows walked no q block is fetched twice, except by entries that compute nothing (which
    write zeros) fetching their own block, as in splash's unpacked tables. The q blocks that no
    row fetched are never written and come back as zeros."""
    heads, L, head_dim = q.shape
    kv_heads, kv_len, _ = k.shape
    grid_height = table_grid_size(info, axis=-2)

    def q_map(j, h, i, *tables):
        return h, _next(h, i, j, tables, next_i=True)[0], 0

    def row_map(j, h, i, *tables):  # lse, di: [heads, SUBLANES, L]
        return h, 0, _next(h, i, j, tables, next_i=True)[0]

    def kv_map(j, h, *_):
        return _kv_head(h, heads, kv_heads), j, 0

    q_spec = pl.BlockSpec((None, bq, head_dim), q_map)
    kv_spec = pl.BlockSpec((None, bkv, head_dim), kv_map)
    row_spec = pl.BlockSpec((None, SUBLANES, bq), row_map)
    rows = lambda x: jnp.broadcast_to(x[:, None], (heads, SUBLANES, L))  # noqa: E731
    if segment_ids is None:
        seg_specs, seg_arrays = [None, None], [None, None]
    else:
        seg_specs = [pl.BlockSpec((SUBLANES, bq),
                                  lambda j, h, i, *tables: (0, _next(h, i, j, tables, True)[0])),
                     pl.BlockSpec((bkv, LANES), lambda j, *_: (j, 0))]
        seg_arrays = [lax.broadcast_in_dim(segment_ids.q, (SUBLANES, L), (1,)),
                      lax.broadcast_in_dim(segment_ids.kv, (kv_len, LANES), (0,))]
    mask_spec = None if info.partial_mask_blocks is None else pl.BlockSpec(
        (None, bkv, bq), lambda j, h, i, *tables: (_next(h, i, j, tables, True)[1], 0, 0))
    if not fused:
        dq_specs, dq_shapes = [None, None], [None, None]
    else:
        assert kv_len == bkv, "the fused kernel's dq is written per q block: one kv block a call"
        dq_spec, dq_shape = q_spec, _f32(q.shape)
        if bkv == bkv_compute:  # the kernel keeps no dq scratch then
            dq_specs, dq_shapes = [None, dq_spec], [None, dq_shape]
        else:
            dq_specs = [_scratch((bq, head_dim)), dq_spec]
            dq_shapes = [_f32((bq, head_dim)), dq_shape]
    kernel = functools.partial(
        sk._flash_attention_dkv_kernel,  # pylint: disable=protected-access
        mask_value=mask_value, num_q_heads=heads, num_kv_heads=kv_heads, is_mqa=False,
        bq=bq, bkv=bkv, bkv_compute=bkv_compute,
        attn_logits_soft_cap=soft_cap, mask_function=None, **_LAYOUTS)
    # Every grid axis "arbitrary", as splash has it: dk/dv reduce over heads and q blocks, and
    # its prefetch schedule assumes no megacore split of the kv axis.
    _, _, _, dq, dk, dv = _call(
        kernel, "longctx_splash_dkv", (kv_len // bkv, heads, grid_height),
        [q_spec, kv_spec, kv_spec, *seg_specs, None, row_spec, q_spec, row_spec, mask_spec, None],
        [dq_specs[0], _scratch((bkv, head_dim)), _scratch((bkv, head_dim)), dq_specs[1], kv_spec,
         kv_spec],
        [dq_shapes[0], _f32((bkv, head_dim)), _f32((bkv, head_dim)), dq_shapes[1], _f32(k.shape),
         _f32(v.shape)],
        ("arbitrary", "arbitrary", "arbitrary"), interpret, info,
        q, k, v, *seg_arrays, None, rows(lse), do, rows(di), info.partial_mask_blocks, None)
    if dq is None:
        return None, dk, dv
    return jnp.where(_fetched_q_blocks(info.data_next, grid_height, L, bq), dq, 0.0), dk, dv


def _fetched_q_blocks(data_next, grid_height, L: int, bq: int):
    """bool [1 or heads, L, 1]: the query positions whose q block some walked grid row of the
    dkv tables (data_next [1 or heads, table rows, 1]) fetches; the rest are never written."""
    rows = lax.broadcasted_iota(jnp.int32, data_next.shape, 1)
    fetched = jnp.where(rows < grid_height, data_next, -1)[..., 0]  # [1 or heads, table rows]
    blocks = jnp.any(fetched[:, :, None] == jnp.arange(L // bq), axis=1)
    return jnp.repeat(blocks, bq, axis=1)[..., None]
