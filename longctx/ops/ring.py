"""Ring attention over the `sp` mesh axis: ppermute schedule, float32 online-softmax merge,
custom_vjp whose backward is a second ring.

Shapes (this device's shard, layout order; L = S / sp):
  q, out, dq: [b, L, n, h]     k, v, dk, dv: [b, L, kvh, h]
  segment ids: [b, L]          lse, di: [b, L, n] float32      sinks: [n]
Letters: b batch, L/t local query positions, n query heads, kvh kv heads, h head_dim.

At ring step s device d holds the K/V (and kv segment ids) that started on device (d - s) mod sp.
In a per-row layout (the per-document one) the segment ids are tables.RowTokens: ids and each
token's global position, which travel together, and the blocks come from them (row_blocks.py)
instead of the closed form (ops/block_source.py: one object for each kind, which the ring and
every strategy ask); every step may have work, so the ring visits steps up to the last with a
live block on some device.
Only `run_steps` (steps with work on some device) execute; consecutive run steps are a
`lax.fori_loop` passing K/V one hop per iteration, and a gap between runs is a single ppermute
of the gap's length, so K/V never travel further than the last run step and the traced program
does not grow with sp. At every step each device works out its blocks in closed form and its
live blocks (tables.py: the static mask's blocks, less those whose queries and keys share no
document, per batch row) and skips its kernel when there are none (`lax.cond`). With documents
the ring also ends early: when the run steps are one run, it stops after the last step at which
some device has a live block (`_steps_to_visit`), so K/V travel no further than the documents
reach either (dK/dV then go home by a distance known only at run time, one hop per loop
iteration). The per-step math lives in a backend (splash.py or xla.py), which computes only
live blocks and owns the accumulators the steps add into, in its own layout:

  to_kv_layout(x), from_kv_layout(x)       K, V (and dK, dV) into the layout they travel the
                                           ring in, and back: once per call
  fwd_start(cfg, q, qs, kv_heads, sinks=None) -> (context, acc): what every step reads, and
                                              the forward's accumulator, sinks [n] in it
  fwd_step(cfg, context, acc, k, v, ks, blocks, live, run) -> acc
  fwd_end(cfg, context, acc)               -> (out float32 [b, L, n, h], lse [b, L, n])
  bwd_start(cfg, q, qs, lse, do, di, kv_heads) -> (context, dq)
  bwd_step(cfg, context, (dq, dk, dv), k, v, ks, blocks, live, run) -> (dq, dk, dv), float32
                                           (dk, dv may be K/V's dtype on a ring of one step)
  bwd_end(cfg, context, dq)                -> dq float32 [b, L, n, h]

A ring of one run step (one device, or a mask whose keys never leave their shard) passes the
steps no accumulator (acc None, dq None, dK/dV None): the step's own result is the answer, and a
merge into an empty accumulator would only cost passes over the shard.

splash merges each step's normalised output into the running one (its kernels return that);
xla carries an unnormalised online softmax from step to step, head-major, and normalises once,
so that a step costs no pass over the shard beyond its blocks. The ring hands the sink logits to
its backend's forward, which counts them with its own exponentials, as splash does
(splash_kernels.forward says why); the strategies built on shard_pairs.py add them afterwards
(add_sinks). The sink gradient lives here, once.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from longctx.ops import auto_layout, block_source, masks
from longctx.ops import tables as tables_lib
from longctx.ops import xla
from longctx.ops.shmap import max_over_devices, pick, sum_over_devices, vary_like
from longctx.parallel import document_layout
from longctx.parallel import layout as layout_lib

# The per-step backends: the Pallas TPU splash kernel, and the same math in plain XLA.
IMPLS = ("splash", "xla")


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Everything static about one ring_attention call (hashable: keys the custom_vjp cache)."""
    spec: masks.MaskSpec
    layout: str
    seq_len: int
    sp: int
    bq: int
    bkv: int
    bkv_compute: int
    bkv_dkv_compute: int
    impl: str
    soft_cap: float | None
    scale: float
    axis_name: str
    interpret: bool
    skip_documents: bool = True
    device_kind: str | None = None  # the TPU the kernels are compiled for (their VMEM limit)

    @property
    def tables(self) -> tables_lib.RingTables:
        return tables_lib.ring_tables(self.spec, self.layout, self.seq_len, self.sp, self.bq, self.bkv)


def step_backend(cfg):
    """The module that computes a step for cfg.impl: splash.py or xla.py (interface above)."""
    if cfg.impl == "splash":
        # Imported when first used (lazily, not to break a circle): the splash backend pulls in
        # Pallas, which an impl="xla" run never needs.
        from longctx.ops import splash
        return splash
    return xla


def _shift(tree, hops, cfg):
    """Sends every leaf `hops` devices forward around the ring: device d receives d - hops.
    `hops` may be traced if every device has the same value: then a loop of one-hop sends (as
    many links crossed as one send of that distance, and no copy of the tree per distance), the
    shorter way round (links carry both ways): dK/dV going home after a ring that stopped at its
    second step make one hop back, not sp - 1 forward."""
    if isinstance(hops, jax.Array):
        ahead = hops % cfg.sp
        forward = 2 * ahead <= cfg.sp
        one_hop = lambda step: lambda _, tree: _shift(tree, step, cfg)  # noqa: E731
        tree = lax.fori_loop(0, jnp.where(forward, ahead, 0), one_hop(1), tree)
        return lax.fori_loop(0, jnp.where(forward, 0, cfg.sp - ahead), one_hop(-1), tree)
    hops %= cfg.sp
    if hops == 0:
        return tree
    perm = [(j, (j + hops) % cfg.sp) for j in range(cfg.sp)]
    return jax.tree.map(lambda x: lax.ppermute(x, cfg.axis_name, perm), tree)


def _ring_loop(cfg, travel, acc, state, body, stop=None):
    """Visits the run steps. body(t, travel, acc, state) -> (acc, state).

    `travel` (K, V, kv segment ids) is sent on before the step's compute so the transfer can
    overlap it; `acc` (dK, dV in the backward) is sent after, because the step updates it.
    Returns (acc, state, hops) where hops is how far the travellers are from their owner.
    `stop` (traced, the same on every device; `_stop`): visit only the first `stop` run steps,
    which must be one run; hops is then traced too.
    """
    runs = tables_lib.step_runs(cfg.tables.run_steps)
    assert stop is None or len(runs) == 1, runs
    pos = 0
    for t0, s0, n in runs:
        travel, acc = _shift((travel, acc), s0 - pos, cfg)
        pos = s0

        def it(i, carry, t0=t0):
            travel, acc, state = carry
            nxt = _shift(travel, 1, cfg)
            acc, state = body(t0 + i, travel, acc, state)
            return nxt, _shift(acc, 1, cfg), state

        hops = n - 1 if stop is None else stop - 1
        travel, acc, state = _repeat(it, hops, n - 1, (travel, acc, state))
        pos += hops
        acc, state = body(t0 + hops, travel, acc, state)
    return acc, state, pos


def _repeat(it, count, most: int, carry):
    """it(i, carry) for i in range(count): a fori_loop, or nothing when count is 0. A count known
    only at run time (at most `most`) that can be 1 at most is a cond: a loop of data-dependent
    length keeps its carry twice in XLA (the bench_memory train step at sp=2: 124 vs 116 MB per
    device)."""
    if most == 0:
        return carry
    if most == 1 and not isinstance(count, int):
        return lax.cond(count > 0, lambda c: it(0, c), lambda c: c, carry)
    return lax.fori_loop(0, count, it, carry)


def _steps_to_visit(cfg, d, q_side, ks):
    """How many run steps the ring visits with documents (traced, the same on every device of
    the mesh, not only of this ring): up to the last one at which some device has a live block,
    and at least one. Rows whose documents end inside their shard need no K/V from afar, and
    the K/V stop travelling there. Each device works out its live blocks at every run step, as
    the steps themselves will (block_source: `live_steps`)."""
    live = block_source.of(cfg).live_steps(d, q_side, ks)
    steps = jnp.arange(len(cfg.tables.run_steps), dtype=jnp.int32)
    last = jnp.max(jnp.where(live, steps + 1, 0))
    return jnp.maximum(max_over_devices(last), 1)


def _any_live(cfg, d, t, live, qs):
    """Whether this device computes anything at run step t. Without documents it is the host
    table's answer: a predicate that depends on the data costs XLA memory (the ring alone, 64K
    tokens on v5p:2x2x2: 238 vs 175 MiB of temporaries, measured), which runs without documents
    have no reason to pay; and where the table says every device works at a step known while
    tracing (one device, or a ring of one run step), a Python True: no conditional at all.
    With documents the same holds for a ring of one step: the only step it could skip is one
    with no live block anywhere (rows of padding), which its kernels walk as an empty table."""
    every_device = isinstance(t, int) and cfg.tables.active[:, t].all()
    if qs is None or not cfg.skip_documents:
        return True if every_device else pick(cfg.tables.active, d, t)
    if every_device and _one_step(cfg):
        return True
    return jnp.any(live)


def _stop(cfg, d, q_side, ks):
    """_ring_loop's `stop`: `_steps_to_visit` with documents when the run steps are one run of
    several (the ring can end early), else None (every run step)."""
    documents = q_side is not None and block_source.of(cfg).data_dependent(ks)
    if not documents or not tables_lib.can_stop_early(cfg.tables.run_steps):
        return None
    return _steps_to_visit(cfg, d, q_side, ks)


def _one_step(cfg) -> bool:
    """Whether the ring visits a single run step, whose result is then the whole answer."""
    return len(cfg.tables.run_steps) == 1


def scaled_query(cfg, q):
    """q times the softmax scale, in q's dtype: the kernels take scaled queries."""
    return (q.astype(jnp.float32) * cfg.scale).astype(q.dtype)


def add_sinks(o, lse, aux):
    """(out, lse) of the keys with the sink logits aux [n] added (None: unchanged). The sink is
    one more logit in the denominator, with no value: it only rescales. The strategies built on
    shard_pairs.py add them here, once, in float32, after their steps."""
    if aux is None:
        return o, lse
    lse_all = jnp.logaddexp(lse, aux.astype(jnp.float32)[None, None, :])
    return o * jnp.exp(lse - lse_all)[..., None], lse_all


def backward_inputs(q, out, lse, do):
    """(dO in q's dtype, di, lse for the kernels) of a backward from the forward's out, lse.
    di = rowsum(dO * O), the softmax-backward correction, float32. Rows with nothing to attend
    to (and no sink) have lse = -inf; any finite value makes the kernels' p = exp(masked - lse)
    exactly 0 there, so their gradients are 0, not NaN."""
    do = do.astype(q.dtype)
    di = jnp.einsum("btnh,btnh->btn", do.astype(jnp.float32), out.astype(jnp.float32))
    return do, di, jnp.where(jnp.isfinite(lse), lse, 0.0)


def sink_gradient(aux, lse_k, di):
    """dL/d aux [n] from this device's rows (None without sinks). d lse_all / d aux = p_sink, so
    dL/d aux = -sum_rows p_sink * di. Summed over this shard's rows and batch; the cotangent of
    a replicated input is summed over devices by shard_map (or `sum_over_devices`)."""
    if aux is None:
        return None
    p_sink = jnp.exp(aux.astype(jnp.float32)[None, None, :] - lse_k)
    return (-jnp.sum(p_sink * di, axis=(0, 1))).astype(aux.dtype)


def forward(cfg, q, k, v, qs, ks, aux):
    backend = step_backend(cfg)
    d = lax.axis_index(cfg.axis_name)
    qx = scaled_query(cfg, q)
    source = block_source.of(cfg)
    q_side = source.query_side(qs)
    ctx, state = backend.fwd_start(cfg, qx, qs, k.shape[2], aux)
    if _one_step(cfg):
        state = None

    def body(t, travel, _, state):
        k_t, v_t, ks_t = travel
        blocks, live = source.pair(d, pick(cfg.tables.kv_source, d, t), q_side, qs, ks_t)
        run = _any_live(cfg, d, t, live, qs)
        return (), backend.fwd_step(cfg, ctx, state, k_t, v_t, ks_t, blocks, live, run)

    travel = (backend.to_kv_layout(k), backend.to_kv_layout(v), ks)
    _, state, _ = _ring_loop(cfg, travel, (), state, body, _stop(cfg, d, q_side, ks))
    o, lse = backend.fwd_end(cfg, ctx, state)
    return o.astype(q.dtype), lse


def backward(cfg, res, do):
    q, k, v, qs, ks, aux, out, lse = res
    backend = step_backend(cfg)
    d = lax.axis_index(cfg.axis_name)
    qx = scaled_query(cfg, q)
    do, di, lse_k = backward_inputs(q, out, lse, do)
    source = block_source.of(cfg)
    q_side = source.query_side(qs)
    ctx, dq = backend.bwd_start(cfg, qx, qs, lse_k, do, di, k.shape[2])

    def body(t, travel, acc, dq):
        k_t, v_t, ks_t = travel
        blocks, live = source.pair(d, pick(cfg.tables.kv_source, d, t), q_side, qs, ks_t)
        run = _any_live(cfg, d, t, live, qs)
        # dQ stays with its queries; dK and dV (float32) travel with K and V, and go home below.
        dq, dk, dv = backend.bwd_step(cfg, ctx, (dq, *acc), k_t, v_t, ks_t, blocks, live, run)
        return (dk, dv), dq

    travel = (backend.to_kv_layout(k), backend.to_kv_layout(v), ks)
    if _one_step(cfg):
        dq = zk = None
    else:
        zk = vary_like(jnp.zeros(travel[0].shape, jnp.float32), q)
    (dk, dv), dq, hops = _ring_loop(cfg, travel, (zk, zk), dq, body, _stop(cfg, d, q_side, ks))
    dk, dv = _shift((dk, dv), -hops, cfg)  # home: the owner of this K/V shard
    dk, dv = backend.from_kv_layout(dk), backend.from_kv_layout(dv)
    dq = backend.bwd_end(cfg, ctx, dq)
    dq = (dq * cfg.scale).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, sink_gradient(aux, lse_k, di)


# What padding becomes inside the ring: different ids on the query and key side, so that the
# kernels' id comparison never pairs a padding query with a padding key.
PAD_Q, PAD_KV = -1, -2


def _kernel_segment_ids(q_ids, kv_ids, positions, chunk_size, layout, seq_len, axis_name):
    """The int32 ids the kernels compare: padding (<= 0) split into PAD_Q / PAD_KV, and with
    `chunk_size` every (document, chunk of the document) made its own id.

    A chunk's id is 1 + the global position where it starts, g - (p mod chunk_size) for a token
    at global position g and in-document position p: unique per chunk (a chunk starts inside its
    own document) and non-decreasing along the sequence, as packed ids are, so the block ranges
    of ops/tables.py stay tight. Only the query side needs this device's global positions; the
    K/V side is computed here, before the ring, and travels with K/V."""
    q_ids, kv_ids = jnp.asarray(q_ids).astype(jnp.int32), jnp.asarray(kv_ids).astype(jnp.int32)
    if chunk_size is not None:
        if layout_lib.per_row(layout):
            g = document_layout.global_positions(q_ids, jnp.asarray(positions, jnp.int32))
        else:
            g = layout_lib.positions_on_device(layout, seq_len, lax.axis_size(axis_name),
                                               lax.axis_index(axis_name),
                                               jnp.arange(q_ids.shape[1]))[None, :]
        chunk_start = g - jnp.asarray(positions, jnp.int32) % chunk_size + 1
        q_ids = jnp.where(q_ids > 0, chunk_start, q_ids)
        kv_ids = jnp.where(kv_ids > 0, chunk_start, kv_ids)
    return jnp.where(q_ids > 0, q_ids, PAD_Q), jnp.where(kv_ids > 0, kv_ids, PAD_KV)


def differentiable(cfg: RingConfig, forward_fn, backward_fn):
    """attention(q, k, v, qs, ks, aux) -> out under a custom VJP, from a strategy's
    forward_fn(cfg, q, k, v, qs, ks, aux) -> (out, lse) and backward_fn(cfg, residuals, d_out) ->
    the six cotangents: the ring's here, the other strategies' in ops/context_parallel.py. The
    residuals are the call's own inputs and (out, lse), nothing per step."""

    @jax.custom_vjp
    def attention(q, k, v, qs, ks, aux):
        return forward_fn(cfg, q, k, v, qs, ks, aux)[0]

    def fwd(q, k, v, qs, ks, aux):
        out, lse = forward_fn(cfg, q, k, v, qs, ks, aux)
        return out, (q, k, v, qs, ks, aux, out, lse)

    # optimize_remat: under lax.scan (the model's layer loop) JAX would otherwise linearise the
    # forward ring itself and keep every step's probabilities, sp x heads x L x L per device.
    attention.defvjp(fwd, functools.partial(backward_fn, cfg), optimize_remat=True)
    return attention


@functools.lru_cache(maxsize=None)
def ring_fn(cfg: RingConfig):
    """The differentiable ring for one static configuration."""
    return differentiable(cfg, forward, backward)


def _block_sizes(block_sizes, shard_len, impl, layout):
    """(bq, bkv, bkv_compute, bkv_dkv_compute) from None | int | splash BlockSizes."""
    # (Pallas, loaded lazily: an impl="xla" run needs only its BlockSizes type, and only here)
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    if block_sizes is None:
        block_sizes = masks.default_block_size(shard_len, layout)
    if isinstance(block_sizes, int) and not isinstance(block_sizes, bool):
        compute = compute_block(block_sizes)
        sizes = (block_sizes, block_sizes, compute, compute)
    elif isinstance(block_sizes, sk.BlockSizes):
        bs = block_sizes
        if not bs.use_fused_bwd_kernel:
            raise ValueError("block_sizes.use_fused_bwd_kernel=False: the ring's backward is one "
                             "fused kernel (ops/splash_kernels.py); leave it True")
        # One table set serves the forward, dq and dkv kernels, so their (q, kv) blocks must agree.
        for name in ("block_q_dq", "block_q_dkv"):
            if getattr(bs, name) not in (None, bs.block_q):
                raise ValueError(f"block_sizes.{name}={getattr(bs, name)} must equal "
                                 f"block_sizes.block_q={bs.block_q} (one mask table per ring step)")
        for name in ("block_kv_dq", "block_kv_dkv"):
            if getattr(bs, name) not in (None, bs.block_kv):
                raise ValueError(f"block_sizes.{name}={getattr(bs, name)} must equal "
                                 f"block_sizes.block_kv={bs.block_kv} (one mask table per ring step)")
        sizes = (bs.block_q, bs.block_kv, bs.block_kv_compute or bs.block_kv,
                 bs.block_kv_dkv_compute or bs.block_kv)
    else:
        raise ValueError(f"block_sizes={block_sizes!r} must be None, an int or a splash BlockSizes")
    names = ("block_q", "block_kv", "block_kv_compute", "block_kv_dkv_compute")
    for name, val in zip(names, sizes):
        if val < 1 or shard_len % val:
            raise ValueError(f"block_sizes: {name}={val} does not divide the shard length "
                             f"L={shard_len}")
        if impl == "splash" and val % 128:
            raise ValueError(f"block_sizes: {name}={val} must be a multiple of 128 for "
                             "impl='splash' (TPU lanes)")
    if sizes[1] % sizes[2] or sizes[1] % sizes[3]:
        raise ValueError(f"block_sizes: block_kv={sizes[1]} must be a multiple of the compute "
                         f"blocks {sizes[2]} and {sizes[3]}")
    return sizes


COMPUTE_BLOCK = 512


def compute_block(block: int) -> int:
    """How many keys a kernel multiplies at once inside a block of `block`: up to 512, as splash's
    own recipes have it. Larger blocks fetch less often; larger score tiles only take VMEM. The
    chip's benchmark (stock and tokamax splash) and test tier (stock) give the kernels they set
    beside longctx's the same, so that they compute alike."""
    compute = min(block, COMPUTE_BLOCK)
    return compute if block % compute == 0 else block


def _tpu_device_kind():
    """The TPU we are tracing for ("TPU v5 lite", ...), or None off TPU: the shard_map mesh's
    devices (AOT for a TPU topology on a CPU host), else the default backend's."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if dev is not None:
        return dev.device_kind if dev.platform == "tpu" else None
    if jax.default_backend() != "tpu":
        return None
    return jax.devices()[0].device_kind


def ring_attention(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                   softmax_aux=None, *, positions=None, causal=False, sliding_window=None,
                   chunk_size=None, logits_soft_cap=None, softmax_scale=None, axis_name="sp",
                   layout="contiguous", impl="splash", block_sizes=None, skip_documents=True):
    """Attention of this device's query shard over the whole sequence split across `axis_name`.

    Call inside `jax.shard_map` with `axis_name` bound. query [b, L, heads, head_dim] and
    key/value [b, L, kv_heads, head_dim] are this device's shards in `layout` order; masks are
    evaluated on global natural-order positions (see longctx.parallel.layout). Segment ids [b, L] int32
    (documents) travel with K/V; an id <= 0 is padding, which attends to nothing and is attended
    by nothing. Blocks whose queries and keys share no document are skipped (ops/tables.py).
    positions [b, L]: each token's position in its document (the model's RoPE positions); with
    segment ids and chunk_size they make chunked attention per document, chunks counted from
    each document's start, as at inference. layout="per_document" (each row laid out from its
    documents by the data pipeline, parallel/document_layout.py) needs segment ids and
    positions: a token's global position is then segment id - 1 + its position, and the blocks
    of each step are classed per row from the data (ops/row_blocks.py). softmax_aux [heads] are attention-sink logits
    (differentiable). impl="splash" runs the Pallas TPU kernel (interpret mode off TPU);
    impl="xla" the same schedule in plain XLA. block_sizes: None (masks.default_block_size:
    512/256/128 dividing L, or L/2 for zigzag), an int (keys computed up to 512 at a time
    inside a block), or a splash BlockSizes (block_q, block_kv and the compute blocks; the
    backward is always one fused kernel). skip_documents=False computes every block the static
    mask keeps and leaves documents to the element-wise mask (the same result, slower: for
    measuring what the skipping buys). Returns [b, L, heads, head_dim] in query's dtype.
    """
    cfg, q_ids, kv_ids, aux = prepare(
        query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, positions=positions,
        causal=causal, sliding_window=sliding_window, chunk_size=chunk_size,
        logits_soft_cap=logits_soft_cap, softmax_scale=softmax_scale, axis_name=axis_name,
        layout=layout, impl=impl, block_sizes=block_sizes, skip_documents=skip_documents)
    return ring_fn(cfg)(query, key, value, q_ids, kv_ids, aux)


def ring_attention_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                           softmax_aux=None, **kwargs):
    """`ring_attention`'s forward alone: (out, lse), lse [b, L, heads] float32 the logsumexp of
    each query's scores (sinks included). For callers that write their own VJP around the ring
    (longctx.model.attention keeps fewer residuals than `ring_attention` does); the same keywords."""
    cfg, q_ids, kv_ids, aux = prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                       softmax_aux, **kwargs)
    return forward(cfg, query, key, value, q_ids, kv_ids, aux)


def ring_attention_backward(query, key, value, out, lse, d_out, q_segment_ids=None,
                            kv_segment_ids=None, softmax_aux=None, **kwargs):
    """The ring's backward from the forward's (out, lse): (d_query, d_key, d_value, d_aux), the
    gradients of `ring_attention` for the cotangent `d_out`. d_aux (None without sinks) is the
    gradient of the replicated softmax_aux, summed over every device."""
    cfg, q_ids, kv_ids, aux = prepare(query, key, value, q_segment_ids, kv_segment_ids,
                                       softmax_aux, **kwargs)
    dq, dk, dv, _, _, daux = backward(cfg, (query, key, value, q_ids, kv_ids, aux, out, lse), d_out)
    return dq, dk, dv, None if daux is None else sum_over_devices(daux)


def prepare(query, key, value, q_segment_ids, kv_segment_ids, softmax_aux, *, positions=None,
             causal=False, sliding_window=None, chunk_size=None, logits_soft_cap=None,
             softmax_scale=None, axis_name="sp", layout="contiguous", impl="splash",
             block_sizes=None, skip_documents=True):
    """Checks the arguments; returns the static RingConfig, the kernels' segment ids and the
    sink logits marked device-varying."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    known = layout_lib.LAYOUTS + layout_lib.ROW_LAYOUTS + ("auto",)
    if layout not in known:
        raise ValueError(f"layout={layout!r} is not one of {known}")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape} must all be "
                         "[batch, L, heads, head_dim]")
    b, L, heads, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key {key.shape} and value {value.shape} must have the same shape")
    if key.shape[0] != b or key.shape[1] != L or key.shape[3] != head_dim:
        raise ValueError(f"key {key.shape} does not match query {query.shape} in batch, shard "
                         "length or head_dim")
    kv_heads = key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads={heads} is not divisible by key/value kv_heads={kv_heads}")
    if q_segment_ids is None and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids was given without q_segment_ids")
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    for name, seg in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if seg is not None and tuple(seg.shape) != (b, L):
            raise ValueError(f"{name} has shape {tuple(seg.shape)}, expected (batch, L) = {(b, L)}")
    if positions is not None and tuple(positions.shape) != (b, L):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected (batch, L) = {(b, L)}")
    per_row = layout_lib.per_row(layout)
    if per_row and (q_segment_ids is None or positions is None):
        raise ValueError(f"layout={layout!r} needs segment ids and positions: each token's global "
                         "position is segment id - 1 + its position in its document "
                         "(parallel/document_layout.py)")
    per_document_chunks = chunk_size is not None and q_segment_ids is not None
    if per_document_chunks and positions is None:
        raise ValueError("chunk_size with segment ids needs positions (each token's position in "
                         "its document): chunks start at every document's start")
    if softmax_aux is not None and tuple(softmax_aux.shape) != (heads,):
        raise ValueError(f"softmax_aux has shape {tuple(softmax_aux.shape)}, expected (heads,) = "
                         f"{(heads,)}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be positive")
    spec = masks.make_mask_spec(causal, sliding_window, chunk_size)
    try:
        sp = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} is not bound: call ring_attention inside "
                         "jax.shard_map over a mesh with that axis") from e
    seq_len = L * sp
    layout = auto_layout.resolve_layout(layout, seq_len, sp, causal=causal,
                                  sliding_window=sliding_window, chunk_size=chunk_size)
    if per_row:
        q_where, kv_where = (document_layout.global_positions(jnp.asarray(ids, jnp.int32),
                                                              jnp.asarray(positions, jnp.int32))
                             for ids in (q_segment_ids, kv_segment_ids))
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = _kernel_segment_ids(
            q_segment_ids, kv_segment_ids, positions, spec.chunk if per_document_chunks else None,
            layout, seq_len, axis_name)
    if per_row:
        q_segment_ids = tables_lib.RowTokens(q_segment_ids, q_where)
        kv_segment_ids = tables_lib.RowTokens(kv_segment_ids, kv_where)
    if per_document_chunks:
        # Chunks are now in the ids; what stays static is that a chunk spans at most chunk_size
        # tokens: a causal window of chunk_size - 1, which keeps the ring's pruning.
        spec = masks.within_chunk_window(spec)
    bq, bkv, bkvc, bkvc_dkv = _block_sizes(block_sizes, L, impl, layout)
    device_kind = _tpu_device_kind() if impl == "splash" else None
    if device_kind is not None:
        from longctx.ops import splash_kernels  # lazily: Pallas TPU, for impl="splash" only
        splash_kernels.check_vmem(bq, bkv, max(bkvc, bkvc_dkv), head_dim, query.dtype.itemsize,
                                  splash_kernels.Masking(spec != masks.MaskSpec(),
                                                         q_segment_ids is not None), device_kind)
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    cfg = RingConfig(spec=spec, layout=layout, seq_len=seq_len, sp=sp, bq=bq, bkv=bkv,
                     bkv_compute=bkvc, bkv_dkv_compute=bkvc_dkv, impl=impl,
                     soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                     scale=scale, axis_name=axis_name,
                     interpret=impl == "splash" and device_kind is None,
                     skip_documents=bool(skip_documents), device_kind=device_kind)
    if softmax_aux is not None:
        # The sink gradient of a replicated aux is summed over devices by the cast's transpose.
        softmax_aux = vary_like(softmax_aux, query)
    return cfg, q_segment_ids, kv_segment_ids, softmax_aux
