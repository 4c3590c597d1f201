"""A decoder layer's attention over the mesh, and what its backward keeps (`attention.residuals`).

The ring runs in a `jax.shard_map` over the mesh, on each device's shard of the sequence
(`longctx.ops.ring_attention`). Its backward needs q, k, v, the output and the logsumexp of every
layer; with layers scanned and their other activations rematerialised, those are most of what a
long sequence keeps alive across the forward pass. The policies:

  save_qkv       the ring's own VJP keeps q, k, v, out and logsumexp per layer (the default).
  recompute_qkv  keeps only out and logsumexp (and the layer input, which the rematerialised
                 block keeps anyway); the backward recomputes q, k, v from the layer input. Costs
                 one more run of the norm and the q/k/v projections per layer, cheap next to a
                 ring, and saves (heads + 2 * kv_heads) * head_dim values per token per layer.
  offload_qkv    the same VJP as recompute_qkv but q, k, v are not recomputed: they, out and the
                 logsumexp are moved to host memory ("pinned_host") after the forward ring and
                 brought back for the backward. Only where the platform has host memory spaces
                 (TPU; on CPU host and device memory are one).

All three give the same gradients (tests/test_attention_residuals.py). MFU counts model FLOPs
only, so recomputed projections are not credited and show as a lower MFU; longctx.flops'
`recomputed_flops_per_step` counts them for each remat policy x residual policy.
"""

from __future__ import annotations

import functools

import jax

from longctx import config as config_lib
from longctx import mesh as mesh_lib
from longctx import ops
from longctx.ops import ring as ring_lib

RESIDUAL_POLICIES = ("save_qkv", "recompute_qkv", "offload_qkv")

ATTN_ACTIVATION = ("activation_batch", "activation_length", "activation_heads", "activation_head_dim")
TOKEN_ACTIVATION = ("activation_batch", "activation_length")
_LSE_ACTIVATION = ("activation_batch", "activation_length", "activation_heads")


def _ring_keywords(attention_config, layout: str) -> dict:
    a = attention_config
    return dict(**config_lib.mask_kwargs(a), logits_soft_cap=a.logits_soft_cap,
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


def ring_over_mesh(q, k, v, segment_ids, positions, sinks, attention_config, layout: str):
    """Global [b, t, n, h] arrays in, ring attention on each device's sequence shard, global out;
    the ring's own VJP (the save_qkv policy). `positions` (in-document) start chunked
    attention's chunks at each document's start."""
    attend = functools.partial(ops.ring_attention, **_ring_keywords(attention_config, layout))
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
    keywords = _ring_keywords(attention_config, layout)
    positions = _ring_positions(segment_ids, positions)

    def per_shard(q, k, v, segment_ids, positions, sinks):
        return ring_lib.ring_attention_forward(q, k, v, segment_ids, segment_ids, sinks,
                                               positions=positions, **keywords)

    qkv, lse = _specs(ATTN_ACTIVATION, _LSE_ACTIVATION)
    in_specs = (qkv, qkv, qkv, *_doc_inputs(segment_ids, positions, sinks))
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=(qkv, lse))(
        q, k, v, segment_ids, positions, sinks)


def _backward_over_mesh(q, k, v, out, lse, d_out, segment_ids, positions, sinks, attention_config,
                        layout):
    """(dq, dk, dv, d_sinks) of the ring on global arrays."""
    keywords = _ring_keywords(attention_config, layout)
    positions = _ring_positions(segment_ids, positions)

    def per_shard(q, k, v, out, lse, d_out, segment_ids, positions, sinks):
        return ring_lib.ring_attention_backward(q, k, v, out, lse, d_out, segment_ids, segment_ids,
                                                sinks, positions=positions, **keywords)

    qkv, lse_spec = _specs(ATTN_ACTIVATION, _LSE_ACTIVATION)
    doc_specs = _doc_inputs(segment_ids, positions, sinks)
    in_specs = (qkv, qkv, qkv, qkv, lse_spec, qkv, *doc_specs)
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=(qkv, qkv, qkv, doc_specs[2]))(
        q, k, v, out, lse, d_out, segment_ids, positions, sinks)


def _to_memory(tree, kind: str):
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host if kind == "host"
                                                 else jax.memory.Space.Device), tree)


def _ring_with_own_vjp(project, attention_config, layout: str, offload: bool):
    """attend(x, weights, positions, segment_ids, sinks) -> out: `project(x, weights, positions)`
    -> (q, k, v), then the ring, under a VJP that keeps the policy's residuals."""

    def forward(x, weights, positions, segment_ids, sinks):
        q, k, v = project(x, weights, positions)
        out, lse = _forward_over_mesh(q, k, v, segment_ids, positions, sinks, attention_config, layout)
        return (q, k, v), out, lse

    @jax.custom_vjp
    def attend(x, weights, positions, segment_ids, sinks):
        return forward(x, weights, positions, segment_ids, sinks)[1]

    def attend_fwd(x, weights, positions, segment_ids, sinks):
        qkv, out, lse = forward(x, weights, positions, segment_ids, sinks)
        kept = _to_memory((qkv, out, lse), "host") if offload else (None, out, lse)
        return out, (x, weights, positions, segment_ids, sinks, kept)

    def attend_bwd(residuals, d_out):
        x, weights, positions, segment_ids, sinks, kept = residuals
        qkv, out, lse = _to_memory(kept, "device") if offload else kept
        # The projection's pullback; under recompute_qkv its forward, run again here, gives q, k,
        # v too (under offload_qkv they come back from the host, and XLA drops the unused rerun).
        (q, k, v), pullback = jax.vjp(lambda x, w: project(x, w, positions), x, weights)
        if offload:
            q, k, v = qkv
        dq, dk, dv, d_sinks = _backward_over_mesh(q, k, v, out, lse, d_out.astype(out.dtype),
                                                  segment_ids, positions, sinks, attention_config,
                                                  layout)
        dx, d_weights = pullback((dq, dk, dv))
        return dx, d_weights, None, None, d_sinks

    attend.defvjp(attend_fwd, attend_bwd, optimize_remat=True)
    return attend


def attention(project, x, weights, positions, segment_ids, sinks, attention_config, layout: str,
              remat=lambda f: f):
    """The layer's attention output [b, t, n, h] for input x [b, t, d]: `project(x, weights,
    positions)` -> (q, k, v) (a pure function of its arrays; global arrays, sequence over sp),
    then the ring, keeping `attention_config.residuals`. `remat` (the block's
    rematerialisation) wraps the projection under save_qkv, where the ring's own VJP keeps
    q, k, v and the projection's residuals would be kept too; the other policies keep only x."""
    policy = attention_config.get("residuals", "save_qkv")
    if policy not in RESIDUAL_POLICIES:
        raise ValueError(f"attention.residuals={policy!r} is not one of {RESIDUAL_POLICIES}")
    if policy == "save_qkv":
        q, k, v = remat(project)(x, weights, positions)
        return ring_over_mesh(q, k, v, segment_ids, positions, sinks, attention_config, layout)
    attend = _ring_with_own_vjp(project, attention_config, layout, offload=policy == "offload_qkv")
    return attend(x, weights, positions, segment_ids, sinks)
