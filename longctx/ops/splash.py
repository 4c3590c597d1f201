"""The ring step on JAX's Pallas TPU splash-attention kernels (interpret mode off TPU).

Per (device, run step) the MaskInfo is built on device from the step's blocks (ops/tables.py)
and handed to splash's own forward (save_residuals: out + logsumexp) and backward kernels,
which skip empty blocks and apply partial blocks, segment ids and the soft cap. The backward
is splash's fused kernel (dq, dk and dv from one pass over the blocks; on CPU, causal 8K,
sp=4: 25-32% faster than its separate dq and dkv kernels, which each recompute the
probabilities), called one kv block at a time, each call's dq added into the ring's (see
_fused_bwd_step); a splash BlockSizes with use_fused_bwd_kernel=False selects the two kernels.
Splash's public `make_splash_mha` builds its MaskInfo from one static mask for the whole
sequence; a ring needs a different one per (device, step), so we call splash's kernels below
that layer with our own tables, through ops/splash_kernels.py, whose pallas_calls return the
step's out, dq, dk and dv in float32 (the ring sums them over steps; splash's wrappers would
round each to the input dtype first). Sinks are *not* given to the kernel: they enter once, in
the ring's float32 merge. Shapes: see ring.py. Kernels work per batch row (vmap over b), on
[heads, L, head_dim].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi
from jax.sharding import PartitionSpec as P

from longctx.ops import splash_kernels as kernels
from longctx.ops import tables as tables_lib
from longctx.ops.shmap import vary_like

MASK_VALUE = sk.DEFAULT_MASK_VALUE


def _partial_index(cfg, blocks):
    """Each partial block's pattern in cfg.tables.partial (ops/tables.py), shared by every kernel
    of the step."""
    return tables_lib.partial_index(cfg.tables, cfg.spec, cfg.layout, cfg.seq_len, cfg.sp, cfg.bq,
                                    cfg.bkv, blocks)


def _mask_info(cfg, blocks, live, index, kernel: str):
    """((data_next, block_mask, mask_next), partial blocks) of this step for `kernel`, built on
    device from its blocks (ops/tables.py). "dq": each q-block row's live blocks packed into the
    grid, the rest computing and fetching nothing. "fwd": the same, with the rows that hold a
    live block first, and a fourth array, the q block of each row (splash_kernels.forward).
    "dkv": as "dq" per kv-block column, partial blocks transposed ([kv, q], as the kernel reads
    them). The arrays are one set per batch row ([b, ...]) when documents make the rows differ,
    else one for all rows."""
    tb = cfg.tables
    partial = None if tb.partial is None else jnp.asarray(tb.partial)
    if kernel in ("fwd", "dq"):
        arrays = tables_lib.grid_tables(blocks.classes, index, live, tb.grid_width, axis=-1)
        if kernel == "fwd":
            arrays, q_blocks = tables_lib.live_rows_first(*arrays)
            arrays += (q_blocks[:, 0],)  # one table for every head
    else:
        arrays = tables_lib.grid_tables(blocks.classes, index, live, tb.grid_height, axis=-2)
        partial = None if partial is None else partial.swapaxes(1, 2)
    if live.shape[0] == 1:  # one MaskInfo for every row
        arrays = tuple(None if x is None else x[0] for x in arrays)
    return arrays, partial


def _info(arrays, partial):
    data, block, nxt = arrays[:3]
    return mi.MaskInfo(data_next=data, block_mask=block, mask_next=nxt,
                       partial_mask_blocks=partial, q_sequence=None)


def _over_rows(one_row, live):
    """`one_row(mask info arrays, *per-row arrays)` over the batch. Shared MaskInfo arrays keep
    a single kernel call for the whole batch (vmap). Arrays that differ per row (segment ids)
    are looped over with lax.map, each row's kernel grid sized by that row's own tables
    (splash_kernels.table_grid_size); vmap would loop too (Pallas cannot batch scalar tables),
    but in jax 0.10.2 that loop drops a grid size known only at run time."""
    if live.shape[0] == 1:
        return lambda info, *rows: jax.vmap(one_row, in_axes=(None,) + (0,) * len(rows))(info, *rows)
    return lambda info, *rows: lax.map(lambda args: one_row(*args), (info, *rows))


def _local(fn, ref, *args):
    """Runs fn(*args), this device's kernel work, as shard-local code with check_vma=False.

    Splash's pallas_calls declare outputs with plain ShapeDtypeStructs (no varying-axes type),
    which shard_map's default check_vma=True rejects, and the Pallas interpreter cannot mix
    device-varying scalar tables with its loop indices. A nested shard_map over no new axes with
    check_vma=False (what the splash docs ask of the caller's shard_map) scopes that to the
    kernel and is recorded in the jaxpr, so remat/scan re-tracing sees the same setting. The
    outputs are then typed as varying like `ref` (this device's query shard).
    """
    mesh = jax.sharding.get_abstract_mesh()
    local = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                          axis_names=frozenset(), check_vma=False)
    return vary_like(local(*args), ref)


def _segments(qs, ks):
    return None if qs is None else sk.SegmentIds(q=qs, kv=ks)


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)  # [b, L, heads, h] <-> [b, heads, L, h]


def _fwd_kernel(cfg, q, k, v, qs, ks, blocks, live):
    """The step's normalised output and logsumexp (float32; empty rows -inf, zero output)."""
    def local(q, k, v, qs, ks, blocks, live):
        arrays, partial = _mask_info(cfg, blocks, live, _partial_index(cfg, blocks), "fwd")

        def one_row(arrays, q1, k1, v1, seg):
            return kernels.forward(_info(arrays, partial), q1, k1, v1, seg, bq=cfg.bq,
                                   bkv=cfg.bkv, bkv_compute=cfg.bkv_compute,
                                   mask_value=MASK_VALUE, soft_cap=cfg.soft_cap,
                                   interpret=cfg.interpret, q_blocks=arrays[3])

        return _over_rows(one_row, live)(arrays, _heads_major(q), _heads_major(k),
                                         _heads_major(v), _segments(qs, ks))

    out, lse = _local(local, q, q, k, v, qs, ks, blocks, live)
    out = _heads_major(out)
    lse = jnp.swapaxes(lse, 1, 2)  # [b, L, n]
    # A row with no allowed key in this step gets lse ~ MASK_VALUE (masked logits inside a
    # computed block), or is in a q block with no live block, which the kernel never wrote.
    # Either way it is empty here: -inf lse and zero output, so the merge gives it exactly zero
    # weight.
    computed = jnp.repeat(jnp.any(live, axis=-1), cfg.bq, axis=-1)  # [b or 1, L]
    valid = (lse > 0.5 * MASK_VALUE) & computed[..., None]
    return jnp.where(valid[..., None], out, 0.0), jnp.where(valid, lse, -jnp.inf)


def _bwd_kernel_inputs(qs, ks, lse, do, di, q, k, v):
    """The backward kernels' per-row inputs, heads-major."""
    return (_heads_major(q), _heads_major(k), _heads_major(v), _segments(qs, ks),
            jnp.swapaxes(lse, 1, 2), _heads_major(do), jnp.swapaxes(di, 1, 2))


def _common(cfg):
    return dict(bq=cfg.bq, bkv=cfg.bkv, mask_value=MASK_VALUE, soft_cap=cfg.soft_cap,
                interpret=cfg.interpret)


def _fused_bwd_step(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq):
    """bwd_step on splash's fused kernel: one pass over the blocks computes dq, dk and dv.

    The kernel writes its dq by q block without adding to it: a q block that several kv blocks
    of one call reach would keep only one kv block's share (splash's wrapper gives it a dq per
    kv block of the call instead, kv_blocks times the attention's own memory: 64 GiB per step
    in bf16 at 65,536 tokens per chip for the 8B shape). So it is called one kv block at a
    time, only on the kv blocks that some query needs, and each block's dq is added into the
    ring's float32 `dq` in place. The loop runs outside the kernel's local region so that the
    accumulator keeps its type and is updated in place (an accumulator inside the region cost a
    second float32 dq: 64K tokens on v5p:2x2x2, 259 vs 177 MiB of temporaries)."""
    arrays, partial = _mask_info(cfg, blocks, live, _partial_index(cfg, blocks), "dkv")
    common = _common(cfg)

    def kernel(arrays, q, k, v, qs, ks, lse, do, di):
        def one_row(arrays, q1, k1, v1, seg, lse1, do1, di1):
            return kernels.backward_dkv(_info(arrays, partial), q1, k1, v1, seg, lse1, do1, di1,
                                        bkv_compute=cfg.bkv_dkv_compute, fused=True, **common)

        return _over_rows(one_row, live)(arrays, *_bwd_kernel_inputs(qs, ks, lse, do, di, q, k, v))

    def one_kv_block(j, carry):
        dq, dk, dv = carry
        column = lambda x: None if x is None else lax.dynamic_slice_in_dim(  # noqa: E731
            x, j, 1, axis=x.ndim - 1)
        keys = lambda x: None if x is None else lax.dynamic_slice_in_dim(  # noqa: E731
            x, j * cfg.bkv, cfg.bkv, axis=1)
        dq_j, dk_j, dv_j = _local(kernel, q, tuple(map(column, arrays)), q, keys(k), keys(v), qs,
                                  keys(ks), lse, do, di)
        put = lambda total, part: lax.dynamic_update_slice_in_dim(  # noqa: E731
            total, _heads_major(part), j * cfg.bkv, axis=1)
        return dq + _heads_major(dq_j), put(dk, dk_j), put(dv, dv_j)

    zeros = vary_like(jnp.zeros(k.shape, jnp.float32), q)
    # The kv blocks that no query needs leave dq unchanged and their dk, dv zero; a call on one
    # would still take a grid step per head.
    needed = jnp.any(live, axis=(0, 1))
    columns = jnp.nonzero(needed, size=needed.shape[0], fill_value=0)[0].astype(jnp.int32)
    return lax.fori_loop(0, jnp.count_nonzero(needed).astype(jnp.int32),
                         lambda i, carry: one_kv_block(columns[i], carry), (dq, zeros, zeros))


def _bwd_kernels(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq):
    """(dQ with this step's added, the step's dK, dV), float32."""
    if cfg.fused_bwd:
        return _fused_bwd_step(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq)
    common = _common(cfg)

    def local(q, k, v, qs, ks, lse, do, di, blocks, live):
        index = _partial_index(cfg, blocks)
        fwd_arrays, fwd_partial = _mask_info(cfg, blocks, live, index, "dq")
        dkv_arrays, dkv_partial = _mask_info(cfg, blocks, live, index, "dkv")

        def one_row(arrays, q1, k1, v1, seg, lse1, do1, di1):
            # dq and dk/dv from two kernels, each recomputing the probabilities.
            dq = kernels.backward_dq(_info(arrays[0], fwd_partial), q1, k1, v1, seg, lse1, do1,
                                     di1, **common)
            _, dk, dv = kernels.backward_dkv(_info(arrays[1], dkv_partial), q1, k1, v1, seg,
                                             lse1, do1, di1, bkv_compute=cfg.bkv_dkv_compute,
                                             fused=False, **common)
            return dq, dk, dv

        return _over_rows(one_row, live)((fwd_arrays, dkv_arrays),
                                         *_bwd_kernel_inputs(qs, ks, lse, do, di, q, k, v))

    dq_s, dk, dv = _local(local, q, q, k, v, qs, ks, lse, do, di, blocks, live)
    return dq + _heads_major(dq_s), _heads_major(dk), _heads_major(dv)


# The ring's backend interface (ring.py): K/V travel as given, [b, L, kvh, h]; the forward's
# accumulator is the normalised output and logsumexp so far, merged with each step's.

def to_kv_layout(x):
    return x


from_kv_layout = to_kv_layout


def _merge(o, lse, o_s, lse_s):
    """Float32 online-softmax merge of two normalised partials; -inf lse means empty."""
    new = jnp.logaddexp(lse, lse_s)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w, w_s = jnp.exp(lse - safe), jnp.exp(lse_s - safe)  # exactly 0 for empty partials
    return o * w[..., None] + o_s * w_s[..., None], new


def _empty(q):
    """A step's output and logsumexp where it computed nothing."""
    b, L, n, h = q.shape
    return vary_like((jnp.zeros((b, L, n, h), jnp.float32),
                      jnp.full((b, L, n), -jnp.inf, jnp.float32)), q)


def fwd_start(cfg, q, qs, kv_heads):
    return (q, qs), _empty(q)


def fwd_step(cfg, ctx, acc, k, v, ks, blocks, live, run):
    # The merge stays outside the cond, the kernel's output its only result: with the merge
    # inside, the ring fwd+bwd at 64K on v5p:2x2x2, batch 2 with documents, took 758 MiB per
    # chip instead of 635.
    q, qs = ctx
    step = lax.cond(run, lambda: _fwd_kernel(cfg, q, k, v, qs, ks, blocks, live),
                    lambda: _empty(q))
    return _merge(*acc, *step)


def fwd_end(cfg, ctx, acc):
    return acc


def bwd_start(cfg, q, qs, lse, do, di, kv_heads):
    return (q, qs, lse, do, di), vary_like(jnp.zeros(q.shape, jnp.float32), q)


def bwd_step(cfg, ctx, acc, k, v, ks, blocks, live, run):
    q, qs, lse, do, di = ctx
    dq, dk, dv = acc
    zeros = vary_like(jnp.zeros(k.shape, jnp.float32), q)
    dq, dk_s, dv_s = lax.cond(
        run, lambda: _bwd_kernels(cfg, q, k, v, qs, ks, lse, do, di, blocks, live, dq),
        lambda: (dq, zeros, zeros))
    return dq, dk + dk_s, dv + dv_s


def bwd_end(cfg, ctx, dq):
    return dq
