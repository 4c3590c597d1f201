"""A Llama-style decoder in Flax NNX whose attention runs around the sp ring.

Einsum legend:
  b batch            t token (this shard's positions, in layout order)
  d model width      f MLP width           v vocabulary
  n query heads      k key/value heads     h head dim

Every parameter carries logical axis names (`out_sharding` metadata); `longctx.parallel.mesh` maps them to
mesh axes, so nothing here names a mesh axis. Layers are stacked along a leading "layers" axis and
run under `lax.scan` with a configurable remat policy, so compile time does not grow with depth.
A hybrid model (`attention.pattern`, longctx/model/layer_types.py) is the same stack and the same
scan: each layer's type index travels beside its parameters, and the body branches on it only
where types differ (RoPE, the query temperature, the attention's mask and strategy), so a
hybrid compiles one layer body as a uniform model does, whatever its pattern, period or remainder.
The model is called under `jax.set_mesh(mesh)`: attention is a `shard_map` over that mesh that
calls `longctx.ops.ring_attention` on each device's shard of the sequence.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from longctx.model import attention as attention_lib
from longctx.model import block_options
from longctx.model import layer_types as layer_types_lib
from longctx.model import remat
from longctx.model import rope as rope_lib
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib

# Parameters are created abstractly and sharded by the trainer (eval_shape -> shardings -> jit),
# so flax must not try to place them eagerly at construction time.
nnx.use_eager_sharding(False)

REMAT_POLICIES = remat.POLICIES  # model.remat_policy's values (longctx/model/remat.py)

_EMBED_ACTIVATION = ("activation_batch", "activation_length", "activation_embed")


def _param(rngs: nnx.Rngs, shape, logical_axes, scale: float | None = None, init: str = "normal",
           dtype=jnp.float32, weight_decay: bool = True):
    """A parameter with its logical axes and whether weight decay applies to it.

    The decay decision is declared here, with the parameter, and read by the optimizer through
    `weight_decay_mask`; no rule downstream guesses it from the array's rank (stacking the
    layers makes every norm scale 2-D)."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        # Truncated-normal fan-in init, the Llama/MaxText default (drawn in float32, then cast).
        value = (jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32) * scale).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(logical_axes), weight_decay=weight_decay)


def weight_decay_mask(params: nnx.State):
    """The tree of `params` with True where weight decay applies: every matrix (embeddings,
    projections, MLP), not the norm scales or attention sinks (the Llama/MaxText convention:
    decaying a norm's gain or a sink's logit toward zero changes what the layer computes, not
    just its size). Works on concrete and abstract (eval_shape) states alike."""
    return jax.tree.map(lambda p: bool(p.get_metadata().get("weight_decay", True)), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def _constrain(x, logical_axes):
    return jax.lax.with_sharding_constraint(x, mesh_lib.logical_to_spec(logical_axes))


def _layer_axes(param: nnx.Variable) -> tuple[str, ...]:
    """The logical axes of one layer's slice of a stacked parameter: its metadata still names the
    "layers" axis that the scan (or the unrolled loop's index) took off."""
    axes = tuple(a for a in param.get_metadata()["out_sharding"] if a != "layers")
    if len(axes) != param[...].ndim:
        raise ValueError(f"parameter of shape {param[...].shape} has logical axes {axes}")
    return axes


def _gathered(value, logical_axes, dtype=None):
    """A layer's parameter as the layer computes with it: gathered over the data-like mesh axes
    it is stored sharded on (longctx.parallel.mesh.gathered_spec), here inside the layer scan, so only one
    layer's weights are ever whole on a device. Cast to `dtype` first when given (float32
    parameters, low-precision compute: the gather then moves half the bytes)."""
    value = value if dtype is None else value.astype(dtype)
    return jax.lax.with_sharding_constraint(value, mesh_lib.gathered_spec(logical_axes))


rms_norm = block_options.rms_norm


def apply_rope(x, positions, rotary: rope_lib.Rotary | None):
    """Rotary embedding from each token's own position: packed documents restart at 0. None: no
    rotary embedding (a NoPE layer type), x as it is.

    The frequencies (and YaRN's cos/sin scale) come from `longctx.model.rope`. The two halves of the
    head dimension are rotated as pairs (x_j, x_{j+h/2}), Hugging Face Llama's `rotate_half`
    convention, so HF checkpoints load without permuting their q/k projections."""
    if rotary is None:
        return x
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rotary.inv_freq)  # [b, t, h/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    if rotary.attention_scaling != 1.0:
        sin, cos = sin * rotary.attention_scaling, cos * rotary.attention_scaling
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# One layer's parameters read before the ring (project_qkv's `weights`) and after it
# (output_and_mlp's), those a block has of them (the block options', block_options.py, only where
# chosen); the sinks go to the ring itself.
_QKV_PARAMS = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm")
_FINISH_PARAMS = ("wo", "post_attn_norm", "mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm")


def _layer_weights(weights, logical_axes, dtype):
    """One layer's weights as it computes with them: gathered, cast to the compute dtype but for
    the norm gains (float32, as the norm computes)."""
    return {name: _gathered(value, logical_axes[name], None if block_options.is_norm(name) else dtype)
            for name, value in weights.items()}


def temperature_scale(positions, temperature: tuple[int, float]):
    """Llama 4's query scale for its NoPE layers, [b, t, 1, 1] float32: 1 + scale * log(1 +
    floor((position + 1) / floor_)), growing with the position so that attention stays sharp over
    long contexts without RoPE's distance signal."""
    floor_, scale = temperature
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_)
    return (1.0 + scale * jnp.log1p(steps))[:, :, None, None]


def project_qkv(x, weights, positions, *, logical_axes, config, rotary, temperature=None):
    """RMSNorm (unless the norms come after the sublayers), then the q/k/v projections (+ their
    bias, QK-norm: block_options.py), RoPE (`rotary`, the layer type's; None: none), the query
    scale and the type's query temperature where it has one: [b, t, d] -> q [b, t, n, h],
    k, v [b, t, kvh, h]. A pure function of its array arguments (`weights`: the layer's
    _QKV_PARAMS), so that the layer's VJP can run it again in the backward (attention.residuals,
    longctx/model/attention.py)."""
    m = config.model
    o = block_options.options(m)
    w = _layer_weights(weights, logical_axes, jnp.dtype(m.dtype))
    y = rms_norm(x, w["attn_norm"], m.norm_eps, o.norm_plus_one) if "attn_norm" in w else x
    q = checkpoint_name(jnp.einsum("btd,dnh->btnh", y, w["wq"]), "query_proj")
    k = checkpoint_name(jnp.einsum("btd,dkh->btkh", y, w["wk"]), "key_proj")
    v = checkpoint_name(jnp.einsum("btd,dkh->btkh", y, w["wv"]), "value_proj")
    if "bq" in w:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if "q_norm" in w:
        q = block_options.norm_heads(q, w["q_norm"], m.norm_eps, o.qk_norm, o.norm_plus_one)
        k = block_options.norm_heads(k, w["k_norm"], m.norm_eps, o.qk_norm, o.norm_plus_one)
    q = apply_rope(q, positions, rotary)
    factor = block_options.query_factor(m)
    if factor is not None:
        q = (q.astype(jnp.float32) * factor).astype(q.dtype)
    if temperature is not None:
        q = (q.astype(jnp.float32) * temperature_scale(positions, temperature)).astype(q.dtype)
    q = _constrain(q, attention_lib.ATTN_ACTIVATION)
    k = _constrain(apply_rope(k, positions, rotary), attention_lib.ATTN_ACTIVATION)
    return q, k, v


def output_and_mlp(x, attention_out, weights, *, logical_axes, config):
    """x + o-projection(attention_out), then + the gated MLP of RMSNorm(.), each sublayer's output
    normed too where model.norm_position says (block_options.py): the rest of the layer, a pure
    function of its arrays (`weights`: the layer's _FINISH_PARAMS) for the same reason."""
    m = config.model
    o = block_options.options(m)
    w = _layer_weights(weights, logical_axes, jnp.dtype(m.dtype))
    attended = checkpoint_name(jnp.einsum("btnh,nhd->btd", attention_out, w["wo"]), "out_proj")
    if "post_attn_norm" in w:
        attended = rms_norm(attended, w["post_attn_norm"], m.norm_eps, o.norm_plus_one)
    x = x + _constrain(attended, _EMBED_ACTIVATION)
    y = rms_norm(x, w["mlp_norm"], m.norm_eps, o.norm_plus_one) if "mlp_norm" in w else x
    mlp = _mlp_in_chunks(y, w, m.get("mlp_chunk_size"), o.mlp_activation)
    if "post_mlp_norm" in w:
        mlp = rms_norm(mlp, w["post_mlp_norm"], m.norm_eps, o.norm_plus_one)
    return x + _constrain(mlp, _EMBED_ACTIVATION)


def _swiglu(y, w, activation: str = "silu"):
    """The gated MLP: SwiGLU, or GeGLU with activation="gelu_tanh" (block_options.py)."""
    gate = block_options.activation(activation)(checkpoint_name(jnp.einsum("...d,df->...f", y, w["w_gate"]),
                                                                "mlp_gate"))
    up = checkpoint_name(jnp.einsum("...d,df->...f", y, w["w_up"]), "mlp_up")
    return checkpoint_name(jnp.einsum("...f,fd->...d", gate * up, w["w_down"]), "mlp_down")


def _mlp_in_chunks(y, w, chunk_size: int | None, activation: str = "silu"):
    """The gated MLP (SwiGLU, or GeGLU) over [b, S, d], `chunk_size` tokens of every sequence shard at a time.

    Its [tokens, mlp_dim] intermediates are the largest arrays of a long-sequence step (8B at
    131,072 tokens per chip: 3.5 GiB each in bf16); in chunks, each chunk's are made, used and,
    in the backward, made again (a checkpoint per chunk), so one chunk's are alive at a time. The
    S axis splits as (sp, chunks, chunk), as in token_nll, keeping every chunk where it is."""
    b, seq_len, d = y.shape
    sp = jax.sharding.get_abstract_mesh().shape.get(mesh_lib.SP, 1)
    if not chunk_size or seq_len // sp <= chunk_size:
        return _swiglu(y, w, activation)
    n_chunks = seq_len // sp // chunk_size
    chunks = jnp.moveaxis(y.reshape(b, sp, n_chunks, chunk_size, d), 2, 0)
    spec = mesh_lib.logical_to_spec((None, "activation_batch", "activation_length", None, None))
    chunks = jax.lax.with_sharding_constraint(chunks, spec)
    # The weights enter the map in float32 and are cast back inside each chunk (exactly: they are
    # compute-dtype values), so the map's backward sums their gradients over the chunks in float32;
    # closed over in bf16, every chunk's contribution would be added in bf16 (token_nll does the
    # same for the unembedding).
    mlp = {name: w[name] for name in ("w_gate", "w_up", "w_down")}
    w32 = {name: value.astype(jnp.float32) for name, value in mlp.items()}

    def chunk_swiglu(c):
        return _swiglu(c, {name: value.astype(mlp[name].dtype) for name, value in w32.items()}, activation)

    out = jax.lax.map(jax.checkpoint(chunk_swiglu), chunks)
    return jnp.moveaxis(jax.lax.with_sharding_constraint(out, spec), 0, 2).reshape(b, seq_len, d)


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + Attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)), attending as the
    layer's type says (a model without a pattern has one type), with the families' block options
    where config.model chooses them (longctx/model/block_options.py). Its parameters are the same
    for every type: one block serves every layer."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        m = config.model
        self.layer_types = layer_types_lib.distinct(config)
        d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
        param = functools.partial(_param, rngs, dtype=jnp.dtype(m.param_dtype))
        pre_norms = block_options.options(m).pre_norms
        self.attn_norm = param((d,), ("norm",), init="ones", weight_decay=False) if pre_norms else None
        self.wq = param((d, n, h), ("embed", "heads", "head_dim"), d ** -0.5)
        self.wk = param((d, k, h), ("embed", "kv_heads", "head_dim"), d ** -0.5)
        self.wv = param((d, k, h), ("embed", "kv_heads", "head_dim"), d ** -0.5)
        self.wo = param((n, h, d), ("heads", "head_dim", "embed"), (n * h) ** -0.5)
        self.sinks = (param((n,), ("heads",), init="zeros", weight_decay=False)
                      if layer_types_lib.any_sinks(config) else None)
        self.mlp_norm = param((d,), ("norm",), init="ones", weight_decay=False) if pre_norms else None
        self.w_gate = param((d, f), ("embed", "mlp"), d ** -0.5)
        self.w_up = param((d, f), ("embed", "mlp"), d ** -0.5)
        self.w_down = param((f, d), ("mlp", "embed"), f ** -0.5)
        # (set after Llama's, none drawn at random: a Llama block's parameters are drawn as without them)
        for name, (shape, axes, init) in block_options.extra_params(m).items():
            setattr(self, name, param(shape, axes, init=init, weight_decay=False))

    def __call__(self, x, positions, segment_ids, type_index, *, config, layout):
        """The layer of type `type_index` (into self.layer_types; traced under the layer scan, a
        host int when unrolled). What the backward keeps is `config.attention.residuals`
        (longctx/model/attention.py). Under save_qkv, rematerialisation (config.model.remat_policy)
        covers everything but the attention ring: the projections before it and the output projection + MLP after it are
        each checkpointed, while the ring runs outside any checkpoint with its own VJP, which
        keeps O(L) residuals; recomputing it would cost a whole ring, and worse, a ring under a
        checkpoint under the layer scan gets linearised by JAX instead of using its VJP, keeping
        every ring step's probabilities (sp x heads x L x L). The other policies put the whole
        layer under one VJP that keeps only x, the ring's output and its logsumexp."""
        m = config.model
        policy = REMAT_POLICIES[m.remat_policy]
        remat = ((lambda f: f) if m.remat_policy == "none"
                 else (lambda f: jax.checkpoint(f, policy=policy, prevent_cse=not m.scan_layers)))
        sinks = None if self.sinks is None else self.sinks[...]
        weights = {name: getattr(self, name)[...] for name in _QKV_PARAMS + _FINISH_PARAMS
                   if getattr(self, name, None) is not None}
        axes = {name: _layer_axes(getattr(self, name)) for name in weights}
        # One projection branch per distinct (RoPE, temperature); decoder_layer makes one attention
        # branch per distinct attention config. Both are picked by the layer's type index, which
        # travels as an argument (the layer's VJP runs the projections again in its backward).
        encodings, encoding_of = layer_types_lib.branches(self.layer_types, lambda t: (t.rotary, t.temperature))
        projections = [functools.partial(project_qkv, logical_axes=axes, config=config, rotary=t.rotary,
                                         temperature=t.temperature) for t in encodings]

        def project(x, qkv_weights, positions, type_index):
            return layer_types_lib.by_type(layer_types_lib.branch_of(encoding_of, type_index), projections,
                                           x, qkv_weights, positions)

        finish = functools.partial(output_and_mlp, logical_axes=axes, config=config)
        return attention_lib.decoder_layer(
            project, finish, x,
            {name: weights[name] for name in _QKV_PARAMS if name in weights},
            {name: weights[name] for name in _FINISH_PARAMS if name in weights},
            positions, segment_ids, sinks, type_index, tuple(t.attention for t in self.layer_types),
            layout, remat=remat)


class Decoder(nnx.Module):
    """Token embedding -> scanned DecoderBlocks -> RMSNorm. `__call__` returns the final hidden
    states; `unembedding()` gives the output projection, applied chunk by chunk by the loss."""

    def __init__(self, config, *, layout: str, rngs: nnx.Rngs):
        m = config.model
        self.config = config
        self.layout = layout  # the concrete sequence layout the data pipeline used
        param = functools.partial(_param, rngs, dtype=jnp.dtype(m.param_dtype))
        # Untied, the table is only looked up (unit scale, as Llama/MaxText). Tied, it is also the
        # output projection: logits = h . embed[v] with h RMS-normalised, so at unit scale they
        # would start with std ~sqrt(d_model) (an initial NLL of ~100 at d=128, not ln(vocab));
        # it is drawn at the scale the untied output projection has.
        self.embed = param((m.vocab_size, m.d_model), ("vocab", "embed"),
                           m.d_model ** -0.5 if m.tie_embeddings else 1.0)

        # Every layer's parameters in one stack, whatever its type (layer_types.py): the parameter
        # tree of every earlier checkpoint of a model without a pattern.
        self.blocks = _stacked_blocks(config, m.num_layers, rngs)
        self.final_norm = param((m.d_model,), ("norm",), init="zeros" if block_options.options(m).norm_plus_one
                                else "ones", weight_decay=False)
        self.unembed = (None if m.tie_embeddings
                        else param((m.d_model, m.vocab_size), ("embed", "vocab"), m.d_model ** -0.5))

    def unembedding(self):
        """[d, v] output projection (the transposed embedding when tied)."""
        return self.embed[...].T if self.unembed is None else self.unembed[...]

    def row_positions(self, shape):
        """[b, S] int32: each token's position in its packed row (0..S-1), in the layout order the
        batch comes in (the layout's permutation: layout slot i holds row position perm[i])."""
        sp = jax.sharding.get_abstract_mesh().shape.get(mesh_lib.SP, 1)
        perm = layout_lib.permutation(self.layout, shape[1], sp).astype(np.int32)
        return _constrain(jnp.broadcast_to(jnp.asarray(perm), shape), attention_lib.TOKEN_ACTIVATION)

    def __call__(self, tokens, positions, segment_ids):
        """Final hidden states [b, S, d] of layout-ordered `tokens` with their in-document
        `positions` and `segment_ids` (ignored when attention.use_segment_ids is off: row
        positions then, and no document mask)."""
        m, config = self.config.model, self.config
        # Look up in the stored (float32) table, then cast the rows: the lookup's backward
        # scatter-adds every occurrence of a token into that token's row, and a low-precision copy
        # of the table would make that sum a bf16 one (a frequent token's row lost most of it).
        x = self.embed[...][tokens]
        scale = block_options.embed_factor(m)  # (Gemma's sqrt(d_model), rounded to model.dtype)
        x = (x if scale is None else x * scale).astype(jnp.dtype(m.dtype))
        for spec in mesh_lib.embedding_lookup_reshards():  # ends at _EMBED_ACTIVATION
            x = jax.lax.with_sharding_constraint(x, spec)
        if not config.attention.use_segment_ids:
            # The "no document masking" ablation: the row is one sequence, attended across
            # documents, so RoPE must see row positions; the in-document positions the batch
            # carries would put earlier documents' keys at wrong distances. (Chunked attention
            # without segment ids already counts its chunks from the row's start.)
            segment_ids, positions = None, self.row_positions(tokens.shape)

        graphdef, stacked = nnx.split(self.blocks)
        type_indices = layer_types_lib.layer_type_indices(config)

        def layer(x, block_state, type_index):
            block = nnx.merge(graphdef, block_state)
            return block(x, positions, segment_ids, type_index, config=config, layout=self.layout)

        if m.scan_layers:
            x, _ = jax.lax.scan(lambda x, xs: (layer(x, *xs), None), x, (stacked, jnp.asarray(type_indices)))
        else:
            for i, type_index in enumerate(type_indices):
                x = layer(x, jax.tree.map(lambda p: p[i], stacked), type_index)
        return rms_norm(x, self.final_norm[...], m.norm_eps, block_options.options(m).norm_plus_one)


def _stacked_blocks(config, count: int, rngs: nnx.Rngs):
    """`count` DecoderBlocks, their parameters stacked on a leading "layers" axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs):
        return DecoderBlock(config, rngs=rngs)

    return make_blocks(rngs)


def token_nll(hidden, unembedding, targets, *, chunk_size: int, soft_cap: float | None, dtype: Any):
    """Per-token negative log-likelihood [b, S] in float32, computed `chunk_size` tokens of every
    sequence shard at a time, so the [b, S, vocab] logits are never held at once (also not in the
    backward pass: each chunk's logits are recomputed)."""
    b, seq_len, d = hidden.shape
    sp = jax.sharding.get_abstract_mesh().shape.get(mesh_lib.SP, 1)
    per_shard = seq_len // sp
    n_chunks = per_shard // chunk_size
    # [b, S, d] -> [chunks, b, sp, chunk, d]: the S axis splits as (sp, chunks, chunk), which keeps
    # every chunk on the device that already holds it.
    h = hidden.reshape(b, sp, n_chunks, chunk_size, d)
    h = jnp.moveaxis(h, 2, 0)
    y = jnp.moveaxis(targets.reshape(b, sp, n_chunks, chunk_size), 2, 0)
    chunk_spec = mesh_lib.logical_to_spec((None, "activation_batch", "activation_length", None, None))
    h = jax.lax.with_sharding_constraint(h, chunk_spec)
    # The unembedding enters the scan in float32 and is cast inside each chunk, so its gradient
    # accumulates across chunks in float32 (a low-precision copy closed over by the scan would
    # sum every chunk's contribution in bf16).
    w32 = unembedding.astype(jnp.float32)

    @jax.checkpoint
    def chunk_nll(h_chunk, y_chunk):
        # Low-precision operands, float32 products: logits are never rounded to bf16 before the
        # logsumexp (a rounding of |logit| * 2^-9 per token, which the loss would inherit).
        logits = jnp.einsum("bpcd,dv->bpcv", h_chunk, w32.astype(dtype),
                            preferred_element_type=jnp.float32)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y_chunk[..., None], axis=-1)[..., 0]
        return logz - picked

    _, nll = jax.lax.scan(lambda c, xs: (c, chunk_nll(*xs)), None, (h, y))
    return jnp.moveaxis(nll, 0, 2).reshape(b, seq_len)


def model_nll(model: Decoder, batch) -> jax.Array:
    """Per-token NLL [b, S] of a packed, layout-ordered batch."""
    m = model.config.model
    hidden = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    return token_nll(hidden, model.unembedding(), batch["targets"],
                     chunk_size=model.config.train.loss_chunk_size,
                     soft_cap=m.final_logits_soft_cap, dtype=jnp.dtype(m.dtype))
