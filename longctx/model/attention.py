"""A decoder layer's attention over the mesh, and what its backward keeps (`attention.residuals`).

Attention runs in a `jax.shard_map` over the mesh, on each device's shard of the sequence, by the
context-parallel strategy `attention.cp` names (`longctx.ops.context_parallel_attention`: the ring,
all-gather, Ulysses, Ulysses x ring or the halo; below, "the ring" stands for whichever runs). Its backward needs q, k, v, the output and the logsumexp of every
layer; with layers scanned and their other activations rematerialised, those are most of what a
long sequence keeps alive across the forward pass. The policies:

  save_qkv       the ring's own VJP keeps q, k, v, out and logsumexp per layer (the default).
  recompute_qkv  the layer keeps only its input, the ring's output and the logsumexp: one VJP
                 around the whole layer recomputes q, k, v (and, as remat nothing_saveable
                 does, the output projection and MLP) from the layer input in the backward.
                 The projections are cheap next to a ring; per token per layer this keeps
                 (heads + 2 * kv_heads) * head_dim values fewer (Llama-3-8B at 131,072
                 tokens on v5p:4x4x4: 11.55 instead of 14.53 GiB of temporaries per chip).
  offload_qkv    the same VJP, but q, k, v, out and the logsumexp are moved to host memory
                 ("pinned_host") after the forward ring and brought back for the backward, so
                 only the layer input stays on the device. Where the platform has host memory
                 spaces (TPU; on CPU "host" and "device" memory are the same RAM).

All three give the same gradients (tests/model/test_attention_residuals.py). MFU counts model FLOPs
only, so recomputed projections are not credited and show as a lower MFU; longctx.model.flops'
`recomputed_flops_per_step` counts them for each remat policy x residual policy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from longctx.model import layer_types
from longctx.ops import context_parallel
from longctx.parallel import mesh as mesh_lib

RESIDUAL_POLICIES = ("save_qkv", "recompute_qkv", "offload_qkv")

ATTN_ACTIVATION = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
TOKEN_ACTIVATION = ("activation_batch", "activation_length")
_LSE_ACTIVATION = ("activation_batch", "activation_length", "activation_heads")


def mask_kwargs(attention_config) -> dict:
    """The mask keywords of `ring_attention` / `resolve_layout` for `config.attention`.

    The config's `sliding_window=w` is a causal window (token i sees [i - w, i]); the ring takes
    (left, right) so that two-sided windows are expressible too.
    """
    a = attention_config
    return {
        "causal": bool(a.causal),
        "sliding_window": None if a.sliding_window is None else (int(a.sliding_window), 0),
        "chunk_size": None if a.chunk_size is None else int(a.chunk_size),
    }


def cp_name(attention_config) -> str:
    """`attention.cp` as set ("auto" included; configs older than the key ran the default)."""
    return attention_config.get("cp", context_parallel.DEFAULT)


def strategy_of(attention_config):
    """The strategy object (ops/strategy.py) `attention.cp` names, with `cp_ulysses` as its
    degree where it takes one (a layer type may inherit a degree its own strategy has no use for)."""
    name = cp_name(attention_config)
    takes = name in context_parallel.REGISTRY and context_parallel.REGISTRY[name].takes_degree
    return context_parallel.named(name, attention_config.get("cp_ulysses") if takes else None)


def strategy_kwargs(attention_config) -> dict:
    """The context-parallel strategy keywords of `context_parallel_attention` for
    `config.attention`."""
    chosen = strategy_of(attention_config)
    return {"strategy": chosen.name, "ulysses_degree": chosen.degree}


def _attention_keywords(attention_config, layout: str) -> dict:
    a = attention_config
    return dict(**mask_kwargs(a), **strategy_kwargs(a), logits_soft_cap=a.logits_soft_cap,
                axis_name=mesh_lib.SP, layout=layout, impl=a.impl, block_sizes=a.block_size)


def _specs(*logical):
    return tuple(None if axes is None else mesh_lib.logical_to_spec(axes) for axes in logical)


def _ring_positions(segment_ids, positions):
    """What the ring needs of the positions: in-document positions start chunked attention's
    chunks at each document's start; with one document per row chunks are on row positions."""
    return None if segment_ids is None else positions


def _doc_inputs(segment_ids, positions, sinks):
    """in_specs of (segment_ids, positions, sinks); positions must be None without documents."""
    return _specs(None if segment_ids is None else TOKEN_ACTIVATION,
                  None if positions is None else TOKEN_ACTIVATION,
                  None if sinks is None else ())


def attention_over_mesh(q, k, v, segment_ids, positions, sinks, attention_config, layout: str):
    """Global [b, t, n, h] arrays in, attention on each device's sequence shard, global out;
    the strategy's own VJP (the save_qkv policy). `positions` (in-document) start chunked
    attention's chunks at each document's start."""
    attend = functools.partial(context_parallel.context_parallel_attention,
                               **_attention_keywords(attention_config, layout))
    positions = _ring_positions(segment_ids, positions)

    def per_shard(q, k, v, segment_ids, positions, sinks):
        return attend(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                      positions=positions, softmax_aux=sinks)

    qkv = _specs(ATTN_ACTIVATION)[0]
    in_specs = (qkv, qkv, qkv, *_doc_inputs(segment_ids, positions, sinks))
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=qkv)(
        q, k, v, segment_ids, positions, sinks)


def _forward_over_mesh(q, k, v, segment_ids, positions, sinks, attention_config, layout):
    """(out, lse) of the ring on global arrays."""
    keywords = _attention_keywords(attention_config, layout)
    positions = _ring_positions(segment_ids, positions)

    def per_shard(q, k, v, segment_ids, positions, sinks):
        return context_parallel.context_parallel_forward(q, k, v, segment_ids, segment_ids, sinks,
                                                         positions=positions, **keywords)

    qkv, lse = _specs(ATTN_ACTIVATION, _LSE_ACTIVATION)
    in_specs = (qkv, qkv, qkv, *_doc_inputs(segment_ids, positions, sinks))
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=(qkv, lse))(
        q, k, v, segment_ids, positions, sinks)


def _backward_over_mesh(q, k, v, out, lse, d_out, segment_ids, positions, sinks, attention_config,
                        layout):
    """(dq, dk, dv, d_sinks) of the ring on global arrays."""
    keywords = _attention_keywords(attention_config, layout)
    positions = _ring_positions(segment_ids, positions)

    def per_shard(q, k, v, out, lse, d_out, segment_ids, positions, sinks):
        return context_parallel.context_parallel_backward(
            q, k, v, out, lse, d_out, segment_ids, segment_ids, sinks, positions=positions,
            **keywords)

    qkv, lse_spec = _specs(ATTN_ACTIVATION, _LSE_ACTIVATION)
    doc_specs = _doc_inputs(segment_ids, positions, sinks)
    in_specs = (qkv, qkv, qkv, qkv, lse_spec, qkv, *doc_specs)
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=(qkv, qkv, qkv, doc_specs[2]))(
        q, k, v, out, lse, d_out, segment_ids, positions, sinks)


def _to_memory(tree, kind: str):
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host if kind == "host"
                                                 else jax.memory.Space.Device), tree)


def _with_sinks(attention_config, sinks):
    """The sinks a type's attention reads: the layer's, if the type has them (a layer of a type
    without sinks carries the row every layer has when some type has them, and ignores it)."""
    return sinks if attention_config.get("attention_sinks") else None


def _per_type(attention_configs, type_index):
    """(the distinct attention configs, the branch of a layer of type `type_index`)."""
    configs, branch_of_type = layer_types.branches(attention_configs, layer_types.attention_key)
    return configs, layer_types.branch_of(branch_of_type, type_index)


def _attention_by_type(q, k, v, segment_ids, positions, sinks, type_index, attention_configs, layout):
    """The layer's type's attention under save_qkv. One branch (a model of one attention config,
    or an unrolled layer): its strategy's own VJP. Several, under the layer scan: one VJP around
    the branches, keeping q, k, v, out and lse, the same for every type, and switching in the
    forward and in the backward. Differentiating through the switch of each strategy's own VJP
    instead compiled to more memory per chip on v5p:4x4x4: gpt-oss-20b at 131,072 tokens (a halo
    type and a ring type) 18.3 GiB against 15.4, Llama-4-Scout at 262,144 50.6 against 43.1
    (docs/fit_gpt_oss_20b.md, fit_llama4_scout.md)."""
    configs, which = _per_type(attention_configs, type_index)
    if len(configs) == 1 or isinstance(which, int):  # (layer_types.branch_of: a host int, unrolled)
        c = configs[0 if len(configs) == 1 else which]
        return attention_over_mesh(q, k, v, segment_ids, positions, _with_sinks(c, sinks), c, layout)
    return _attention_with_one_vjp(attention_configs, layout)(q, k, v, segment_ids, positions, sinks,
                                                              type_index)


def _attention_with_one_vjp(attention_configs, layout: str):
    """attend(q, k, v, segment_ids, positions, sinks, type_index) -> out, under a VJP that keeps
    q, k, v, out and lse and runs the type's backward (`_forward_by_type`, `_backward_by_type`)."""

    @jax.custom_vjp
    def attend(q, k, v, segment_ids, positions, sinks, type_index):
        return attend_fwd(q, k, v, segment_ids, positions, sinks, type_index)[0]

    def attend_fwd(q, k, v, segment_ids, positions, sinks, type_index):
        out, lse = _forward_by_type(q, k, v, segment_ids, positions, sinks, type_index, attention_configs,
                                    layout)
        return out, (q, k, v, out, lse, segment_ids, positions, sinks, type_index)

    def attend_bwd(residuals, d_out):
        q, k, v, out, lse, segment_ids, positions, sinks, type_index = residuals
        dq, dk, dv, d_sinks = _backward_by_type(q, k, v, out, lse, d_out.astype(out.dtype), segment_ids,
                                                positions, sinks, type_index, attention_configs, layout)
        return dq, dk, dv, None, None, d_sinks, None

    # optimize_remat: as for the layer's own VJP below.
    attend.defvjp(attend_fwd, attend_bwd, optimize_remat=True)
    return attend


def _forward_by_type(q, k, v, segment_ids, positions, sinks, type_index, attention_configs, layout):
    """(out, lse) of the layer's type's attention."""
    configs, which = _per_type(attention_configs, type_index)

    def forward(c):
        return lambda q, k, v, s, p, sinks: _forward_over_mesh(q, k, v, s, p, _with_sinks(c, sinks), c, layout)
    return layer_types.by_type(which, [forward(c) for c in configs], q, k, v, segment_ids, positions, sinks)


def _backward_by_type(q, k, v, out, lse, d_out, segment_ids, positions, sinks, type_index,
                      attention_configs, layout):
    """(dq, dk, dv, d_sinks) of the layer's type's attention; d_sinks is zero for a type without
    sinks (every branch must give the same outputs)."""
    configs, which = _per_type(attention_configs, type_index)

    def backward(c):
        def run(q, k, v, out, lse, d_out, s, p, sinks):
            dq, dk, dv, d_sinks = _backward_over_mesh(q, k, v, out, lse, d_out, s, p, _with_sinks(c, sinks),
                                                      c, layout)
            if d_sinks is None and sinks is not None:  # a type that does not read the layer's sinks
                d_sinks = jnp.zeros_like(sinks)
            return dq, dk, dv, d_sinks
        return run
    return layer_types.by_type(which, [backward(c) for c in configs], q, k, v, out, lse, d_out,
                               segment_ids, positions, sinks)


def _layer_with_own_vjp(project, finish, attention_configs, layout: str, offload: bool):
    """layer(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index) -> the
    layer's output, under a VJP that keeps x, the ring's output and its logsumexp (and, offloaded,
    q, k, v).

    The whole layer is one VJP so that the attention output is one residual: with the
    projections after it in a checkpoint of their own, that checkpoint's input would be a second
    (XLA may or may not merge the two). The backward runs `finish` and `project` again for their
    pullbacks (what remat nothing_saveable does in any case); the ring runs forward once and
    backward once. The type index is an argument, not closed over: under the layer scan it is
    traced, and the backward runs in a trace of its own."""

    def forward(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index):
        q, k, v = project(x, qkv_weights, positions, type_index)
        out, lse = _forward_by_type(q, k, v, segment_ids, positions, sinks, type_index, attention_configs,
                                    layout)
        return finish(x, out, finish_weights), ((q, k, v), out, lse)

    @jax.custom_vjp
    def layer(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index):
        return forward(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index)[0]

    def layer_fwd(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index):
        y, (qkv, out, lse) = forward(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index)
        kept = _to_memory((qkv, out, lse), "host") if offload else (None, out, lse)
        return y, (x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index, kept)

    def layer_bwd(residuals, d_y):
        x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index, kept = residuals
        qkv, out, lse = _to_memory(kept, "device") if offload else kept
        _, finish_pullback = jax.vjp(finish, x, out, finish_weights)
        dx, d_out, d_finish = finish_pullback(d_y)
        # Under recompute_qkv the projection's forward, run again here, gives q, k, v; under
        # offload_qkv they come back from the host (and XLA drops the unused rerun).
        (q, k, v), project_pullback = jax.vjp(lambda x, w: project(x, w, positions, type_index), x,
                                              qkv_weights)
        if offload:
            q, k, v = qkv
        dq, dk, dv, d_sinks = _backward_by_type(q, k, v, out, lse, d_out.astype(out.dtype), segment_ids,
                                                positions, sinks, type_index, attention_configs, layout)
        dx_qkv, d_qkv = project_pullback((dq, dk, dv))
        return dx + dx_qkv, d_qkv, d_finish, None, None, d_sinks, None

    # optimize_remat: under the layer scan JAX would otherwise linearise the forward (the ring
    # included) instead of calling this VJP, as for the ring's own (ops/ring.py).
    layer.defvjp(layer_fwd, layer_bwd, optimize_remat=True)
    return layer


def decoder_layer(project, finish, x, qkv_weights, finish_weights, positions, segment_ids, sinks,
                  type_index, attention_configs, layout: str, remat=lambda f: f):
    """One decoder layer around the ring, keeping `attention.residuals` for its backward.

    `project(x, qkv_weights, positions, type_index)` -> (q, k, v) [b, t, heads, h] (global
    arrays, sequence over sp), the ring, then `finish(x, out, finish_weights)` -> the layer's
    output; both pure functions of their arguments. The attention is `attention_configs[type_index]`'s
    (one config per layer type; `type_index` traced under the layer scan, a host int unrolled):
    one branch per distinct config (layer_types.by_type). Under save_qkv the attention keeps its
    own residuals (_attention_by_type) and `remat` (the block's rematerialisation policy) wraps
    project and finish; the other policies recompute everything but the ring in the backward,
    whatever the remat policy.
    The residual policy is one for every type (a property of the step)."""
    policy = attention_configs[0].get("residuals", "save_qkv")
    if policy not in RESIDUAL_POLICIES:
        raise ValueError(f"attention.residuals={policy!r} is not one of {RESIDUAL_POLICIES}")
    if policy == "save_qkv":
        q, k, v = remat(project)(x, qkv_weights, positions, type_index)
        out = _attention_by_type(q, k, v, segment_ids, positions, sinks, type_index, attention_configs, layout)
        return remat(finish)(x, out, finish_weights)
    layer = _layer_with_own_vjp(project, finish, attention_configs, layout, offload=policy == "offload_qkv")
    return layer(x, qkv_weights, finish_weights, positions, segment_ids, sinks, type_index)
