"""The ring step on JAX's Pallas TPU splash-attention kernels (interpret mode off TPU).

Per (device, run step) the host-computed MaskInfo (masks.RingTables) is picked with
lax.axis_index and handed to splash's own forward (save_residuals: out + logsumexp), dq and
dkv kernels, which skip empty blocks and apply partial blocks, segment ids and the soft cap.
Splash's public `make_splash_mha` builds its MaskInfo from one static mask for the whole
sequence; a ring needs a different one per (device, step), so we call the kernel functions
below that layer (`_splash_attention_forward`, `_splash_attention_bwd_dq`, `_splash_attention_
bwd_dkv`) with our own tables. Sinks are *not* given to the kernel: they enter once, in the
ring's float32 merge. Shapes: see ring.py. Kernels work per batch row (vmap over b), on
[heads, L, head_dim].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

from jax.sharding import PartitionSpec as P

from longctx.ops import tables as tables_lib
from longctx.ops.shmap import pick, vary_like

MASK_VALUE = sk.DEFAULT_MASK_VALUE
_HEAD_MINOR = sk.QKVLayout.HEAD_DIM_MINOR


def _mask_infos(cfg, d, t, live, kind, documents: bool):
    """((data_next, block_mask, mask_next), partial blocks) of run step t. With `documents`, the
    static tables with the blocks that are not live switched off and not fetched
    (tables.skip_dead_entries), one set per batch row [b, ...] (one for all rows when b = 1);
    without, the static tables as they are."""
    tb = cfg.tables
    if kind == "fwd":  # forward and dq kernels: rows = q blocks, entries along the grid width
        data, block, nxt, axis = tb.fwd_data_next, tb.fwd_block_mask, tb.fwd_mask_next, -1
        partial = tb.partial
    else:  # dkv kernel: columns = kv blocks, entries along the grid height; partial as [kv, q]
        data, block, nxt, axis = tb.dkv_data_next, tb.dkv_block_mask, tb.dkv_mask_next, -2
        partial = None if tb.partial is None else tb.partial.swapaxes(1, 2)
    rows = live.shape[0]
    data, block = pick(data, d, t), pick(block, d, t)  # [1, q or grid blocks, grid or kv blocks]
    nxt = None if nxt is None else pick(nxt, d, t)
    partial = None if partial is None else jnp.asarray(partial)
    if not documents:
        return (data, block, nxt), partial
    batch = lambda x: None if x is None else jnp.broadcast_to(x[None], (rows, *x.shape))  # noqa: E731
    # Is entry e live? The block it names: (q block, data[e]) forward, (data[e], kv block) dkv.
    entry_live = jnp.take_along_axis(live[:, None], batch(data), axis=axis) & (batch(block) > 0)
    arrays = tables_lib.skip_dead_entries(batch(data), batch(block), batch(nxt), entry_live, axis=axis)
    if rows == 1:  # one MaskInfo for every row
        arrays = tuple(None if x is None else x[0] for x in arrays)
    return arrays, partial


def _documents(cfg, qs) -> bool:
    """Whether blocks are skipped by documents (else the static tables are the whole story)."""
    return qs is not None and cfg.skip_documents


def _info(arrays, partial):
    data, block, nxt = arrays
    return mi.MaskInfo(data_next=data, block_mask=block, mask_next=nxt,
                       partial_mask_blocks=partial, q_sequence=None)


def _over_rows(one_row, live):
    """vmap of `one_row(mask info arrays, *per-row arrays)` over the batch. The MaskInfo arrays
    are batched only when they differ per row (segment ids); shared ones keep a single kernel
    call for the whole batch (per-row scalar tables make Pallas loop over the rows)."""
    return lambda info, *rows: jax.vmap(
        one_row, in_axes=(0 if live.shape[0] > 1 else None,) + (0,) * len(rows))(info, *rows)


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


def fwd_step(cfg, q, k, v, qs, ks, live, d, t):
    del d  # the tables are picked inside the local region, from its own axis_index
    sizes = sk.BlockSizes(block_q=cfg.bq, block_kv=cfg.bkv, block_kv_compute=cfg.bkv_compute)

    def local(q, k, v, qs, ks, live, t):
        arrays, partial = _mask_infos(cfg, lax.axis_index(cfg.axis_name), t, live, "fwd",
                                      _documents(cfg, qs))

        def one_row(arrays, q1, k1, v1, seg):
            out, (lse,) = sk._splash_attention_forward(  # pylint: disable=protected-access
                _info(arrays, partial), q1, k1, v1, seg, None, mask_value=MASK_VALUE,
                is_mqa=False, block_sizes=sizes, residual_checkpoint_name=None,
                save_residuals=True, mask_function=None, attn_logits_soft_cap=cfg.soft_cap,
                interpret=cfg.interpret)
            return out, lse

        return _over_rows(one_row, live)(arrays, _heads_major(q), _heads_major(k),
                                         _heads_major(v), _segments(qs, ks))

    out, lse = _local(local, q, q, k, v, qs, ks, live, t)
    out = _heads_major(out).astype(jnp.float32)
    lse = jnp.swapaxes(lse, 1, 2)  # [b, L, n]
    # A row with no allowed key in this step gets lse ~ MASK_VALUE (masked logits inside a
    # computed block) or -inf with a NaN output (q block with no block at all). Either way it
    # is empty here: -inf lse and zero output, so the merge gives it exactly zero weight.
    valid = lse > 0.5 * MASK_VALUE
    return jnp.where(valid[..., None], out, 0.0), jnp.where(valid, lse, -jnp.inf)


def bwd_step(cfg, q, k, v, qs, ks, lse, do, di, live, d, t):
    del d  # see fwd_step
    layouts = dict(q_layout=_HEAD_MINOR, k_layout=_HEAD_MINOR, v_layout=_HEAD_MINOR)
    common = dict(is_mqa=False, mask_value=MASK_VALUE, attn_logits_soft_cap=cfg.soft_cap,
                  mask_function=None, interpret=cfg.interpret, **layouts)

    def local(q, k, v, qs, ks, lse, do, di, live, t):
        d = lax.axis_index(cfg.axis_name)
        (fwd_arrays, fwd_partial), (dkv_arrays, dkv_partial) = (
            _mask_infos(cfg, d, t, live, kind, _documents(cfg, qs)) for kind in ("fwd", "dkv"))

        def one_row(arrays, q1, k1, v1, seg, lse1, do1, di1):
            dq = sk._splash_attention_bwd_dq(  # pylint: disable=protected-access
                q1, k1, v1, seg, None, lse1, do1, di1, bq=cfg.bq, bkv=cfg.bkv,
                mask_info=_info(arrays[0], fwd_partial), **common)
            _, dk, dv = sk._splash_attention_bwd_dkv(  # pylint: disable=protected-access
                q1, k1, v1, seg, None, lse1, do1, di1, bq=cfg.bq, bkv=cfg.bkv,
                bkv_compute=cfg.bkv_dkv_compute, mask_info=_info(arrays[1], dkv_partial),
                use_fused_bwd_kernel=False, **common)
            return dq, dk, dv

        return _over_rows(one_row, live)(
            (fwd_arrays, dkv_arrays), _heads_major(q), _heads_major(k), _heads_major(v),
            _segments(qs, ks), jnp.swapaxes(lse, 1, 2), _heads_major(do), jnp.swapaxes(di, 1, 2))

    dq, dk, dv = _local(local, q, q, k, v, qs, ks, lse, do, di, live, t)
    f = lambda x: _heads_major(x).astype(jnp.float32)
    return f(dq), f(dk), f(dv)
