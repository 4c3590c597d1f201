"""The ring step on the Pallas TPU kernels of ops/splash_kernels.py (interpret mode off TPU).

The backend interface of ring.py (shapes there). Per (device, run step) the kernels' tables are
built on device from the step's blocks (ops/tables.py): the live blocks packed per q-block row
for the forward and per kv-block column for the backward, each marked partial (masked element
by element from positions and segment ids, in the kernel) or full. The forward returns each
step's normalised output and logsumexp in float32, merged into the running ones here; the
backward is one fused kernel per step, whose float32 dQ, dK and dV are added to the running dQ
and to the dK, dV travelling with K/V (a ring of one step adds nothing to its dK, dV: the kernel
rounds them to K/V's dtype itself, which halves the bytes written and read after it). Sinks
start the forward's accumulator, as a partial with zero output and the sink as its logsumexp; a
ring of one step, which has no accumulator, gives them to its forward kernel instead.

Layouts: the kernels take heads-major operands, so q (and dQ, out, lse) are transposed once per
call, in fwd_start / bwd_start, and K/V travel the ring heads-major ([b, kv_heads, L, h]:
to_kv_layout), as do their float32 dK, dV.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from longctx.ops import masks as masks_lib
from longctx.ops import splash_kernels as kernels
from longctx.ops import tables as tables_lib
from longctx.ops.shmap import vary_like
from jax.sharding import PartitionSpec as P

# splash's: large and finite, so that a row with every key masked gives exp(0) = 1 terms that
# the online softmax drops once a real score arrives, and never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def to_kv_layout(x):
    """K, V (and dK, dV) from the ring's [b, L, kvh, h] to [b, kvh, L, h]: once per call."""
    return jnp.swapaxes(x, 1, 2)


from_kv_layout = to_kv_layout


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)  # [b, L, n, ...] <-> [b, n, L, ...]


def _masking(cfg, qs) -> kernels.Masking:
    return kernels.Masking(positions=cfg.spec != masks_lib.MaskSpec(), segments=qs is not None)


class _StepMasks(NamedTuple):
    """The element masks' inputs of a step: the queries' allowed key intervals, the keys'
    global positions (None for a mask that keeps every pair), the segment ids (None without
    documents)."""
    q_lo: jax.Array | None
    q_hi: jax.Array | None
    kv_pos: jax.Array | None
    qs: jax.Array | None
    ks: jax.Array | None


def _step_masks(cfg, blocks, qs, ks) -> _StepMasks:
    """In a per-row layout the positions, and so q_lo, q_hi and kv_pos, are [b, L]."""
    if _masking(cfg, qs).positions:
        q_lo, q_hi = cfg.spec.bounds(blocks.q_positions)
        kv_pos = blocks.kv_positions.astype(jnp.int32)
    else:
        q_lo = q_hi = kv_pos = None
    return _StepMasks(q_lo, q_hi, kv_pos, tables_lib.ids_of(qs), tables_lib.ids_of(ks))


def _classes(cfg, blocks, live, qs, ks):
    """The kernels' class of each block of the step (tables.kernel_classes): documents decide
    which static full blocks stay unmasked, whether or not they also prune (skip_documents)."""
    if qs is None:
        return tables_lib.kernel_classes(blocks.classes, live, None, None)
    return tables_lib.kernel_classes(
        blocks.classes, live, tables_lib.block_documents(tables_lib.ids_of(qs), cfg.bq),
        tables_lib.block_documents(tables_lib.ids_of(ks), cfg.bkv))


def _common(cfg):
    return dict(bq=cfg.bq, bkv=cfg.bkv, mask_value=MASK_VALUE, soft_cap=cfg.soft_cap,
                interpret=cfg.interpret, device_kind=cfg.device_kind)


def _untyped(x):
    """x without its varying-axes type, inside a check_vma=False region: a binary op with an
    untyped operand is untyped there (a unary one keeps the type); XLA removes the + 0."""
    return x + jnp.zeros((), x.dtype)


def _local(fn, ref, *args):
    """fn(*args), this device's kernel call, as shard-local code with check_vma=False.

    Pallas calls declare their outputs with plain ShapeDtypeStructs (no varying-axes type),
    which shard_map's default check_vma=True rejects, and the Pallas interpreter cannot mix
    device-varying operands with its untyped loop state (an input it carries through its grid
    loop comes back untyped). A nested shard_map over no new axes with check_vma=False (what
    the splash docs ask of the caller's shard_map) scopes that to the kernel and is recorded in
    the jaxpr, so remat/scan re-tracing sees the same setting; the operands enter it untyped
    (`_untyped`), and the outputs are typed as varying like `ref` (this device's query shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    local = jax.shard_map(lambda *a: fn(*jax.tree.map(_untyped, a)), mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                          axis_names=frozenset(), check_vma=False)
    return vary_like(local(*args), ref)


def _maybe(run, compute, skipped):
    """compute() where `run`, else skipped(): no conditional where `run` is a host True."""
    if run is True:
        return compute()
    return lax.cond(run, compute, skipped)


class FwdContext(NamedTuple):
    q: jax.Array              # [b, n, L, h], scaled
    qs: jax.Array | None      # [b, L]
    sinks: jax.Array | None   # [n] float32


def fwd_start(cfg, q, qs, kv_heads, sinks=None):
    """The forward's context and accumulator: the normalised output and logsumexp so far,
    heads-major float32: zero output, and the sink logits as the logsumexp (-inf without)."""
    q = _heads_major(q)
    ctx = FwdContext(q, qs, None if sinks is None else sinks.astype(jnp.float32))
    return ctx, _empty_partial(ctx, with_sinks=True)


def _fwd_kernel(cfg, ctx, k, v, ks, blocks, live, with_sinks, every_row):
    """The step's normalised output and logsumexp (float32, heads-major; rows with nothing to
    attend to: zero output, -inf lse, or the sink's where `with_sinks` has the kernel add them).
    `every_row`: the caller knows that every query has an allowed key in a computed block (a
    ring's one step without documents: each query sees itself), so no row needs emptying."""
    classes = _classes(cfg, blocks, live, ctx.qs, ks)
    data, block = tables_lib.grid_tables(classes, cfg.tables.grid_width, axis=-1)
    (data, block), q_blocks = tables_lib.live_rows_first(data, block)
    masks = _step_masks(cfg, blocks, ctx.qs, ks)
    call = lambda *args: kernels.forward(  # noqa: E731
        *args, bkv_compute=cfg.bkv_compute, **_common(cfg))
    out, lse = _local(call, ctx.q, (data, block), q_blocks[:, 0], ctx.q, k, v, *masks,
                      ctx.sinks if with_sinks else None)
    if every_row:
        return out, lse
    # A row with no allowed key in this step has lse ~ MASK_VALUE (masked scores in a computed
    # block; with sinks, the sink's logit), or sits in a q block with no live block, which the
    # kernel never wrote: either way it is empty here, so the merge gives it exactly zero weight.
    computed = jnp.repeat(jnp.any(classes != 0, axis=-1), cfg.bq, axis=-1)[:, None]  # [b|1, 1, L]
    valid = (lse > 0.5 * MASK_VALUE) & computed
    return jnp.where(valid[..., None], out, 0.0), jnp.where(valid, lse, _empty_lse(ctx, with_sinks))


def _merge(o, lse, o_s, lse_s):
    """Float32 online-softmax merge of two normalised partials; -inf lse means empty."""
    new = jnp.logaddexp(lse, lse_s)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w, w_s = jnp.exp(lse - safe), jnp.exp(lse_s - safe)  # exactly 0 for empty partials
    return o * w[..., None] + o_s * w_s[..., None], new


def _empty_lse(ctx, with_sinks):
    """The logsumexp of rows with nothing computed: -inf, or (`with_sinks` and the context has
    them) the sink logits."""
    shape = ctx.q.shape[:3]
    if with_sinks and ctx.sinks is not None:
        return jnp.broadcast_to(ctx.sinks[None, :, None], shape)
    return jnp.full(shape, -jnp.inf, jnp.float32)


def _empty_partial(ctx, with_sinks):
    """(out, lse) with nothing computed: zero output and _empty_lse."""
    return vary_like((jnp.zeros(ctx.q.shape, jnp.float32), _empty_lse(ctx, with_sinks)), ctx.q)


def fwd_step(cfg, ctx, acc, k, v, ks, blocks, live, run):
    # A ring's one step has no accumulator to hold the sinks: its kernel adds them.
    with_sinks = acc is None
    every_row = acc is None and ctx.qs is None  # a ring's one step, no documents
    # The merge stays outside the cond, the kernel's output its only result (a merge inside
    # kept more of the step's buffers alive at once).
    step = _maybe(run, lambda: _fwd_kernel(cfg, ctx, k, v, ks, blocks, live, with_sinks,
                                           every_row),
                  lambda: _empty_partial(ctx, with_sinks))
    return step if acc is None else _merge(*acc, *step)


def fwd_end(cfg, ctx, acc):
    o, lse = acc
    return _heads_major(o), jnp.swapaxes(lse, 1, 2)


class BwdContext(NamedTuple):
    q: jax.Array           # [b, n, L, h], scaled
    qs: jax.Array | None
    lse: jax.Array         # [b, n, L]
    do: jax.Array          # [b, n, L, h]
    di: jax.Array          # [b, n, L]


def bwd_start(cfg, q, qs, lse, do, di, kv_heads):
    """The backward's context and its dQ accumulator (float32, heads-major, zero)."""
    q = _heads_major(q)
    ctx = BwdContext(q, qs, jnp.swapaxes(lse, 1, 2), _heads_major(do), jnp.swapaxes(di, 1, 2))
    return ctx, vary_like(jnp.zeros(q.shape, jnp.float32), q)


def bwd_step(cfg, ctx, acc, k, v, ks, blocks, live, run):
    """(dQ, dK, dV) with this step's added (float32; dK, dV in the travelling layout), or the
    step's own (dK, dV in K/V's dtype) where there is no accumulator: the ring's one step."""
    dkv_dtype = k.dtype if acc[0] is None else jnp.float32

    def compute():
        classes = _classes(cfg, blocks, live, ctx.qs, ks)
        tables = tables_lib.grid_tables(classes, cfg.tables.grid_height, axis=-2)
        masks = _step_masks(cfg, blocks, ctx.qs, ks)
        call = lambda *args: kernels.backward(  # noqa: E731
            *args, bkv_compute=cfg.bkv_dkv_compute, dkv_dtype=dkv_dtype, **_common(cfg))
        step = _local(call, ctx.q, tables, ctx.q, k, v, *masks, ctx.lse, ctx.do, ctx.di)
        return step if acc[0] is None else tuple(a + s for a, s in zip(acc, step))

    def skipped():
        if acc[0] is not None:
            return acc
        zeros = lambda x, dtype: vary_like(jnp.zeros(x.shape, dtype), ctx.q)  # noqa: E731
        return zeros(ctx.q, jnp.float32), zeros(k, dkv_dtype), zeros(v, dkv_dtype)

    return _maybe(run, compute, skipped)


def bwd_end(cfg, ctx, dq):
    return _heads_major(dq)
