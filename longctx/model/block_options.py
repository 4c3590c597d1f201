"""The per-block choices of the model families (`model.*`), each with Llama's value as default.

  model.qk_norm            none | per_head (Qwen3, Gemma 3: RMSNorm over each head's head_dim,
                           of q and of k, before RoPE) | whole (OLMo 2/3: RMSNorm over the whole
                           q projection [heads * head_dim] and the whole k projection)
  model.qkv_bias           a bias on the q, k and v projections, not on the output (Qwen2 / 2.5)
  model.norm_position      pre: x + f(RMSNorm(x)) (Llama) | post: x + RMSNorm(f(x)) (OLMo 2/3) |
                           sandwich: x + RMSNorm(f(RMSNorm(x))) (Gemma 2/3), f the attention and
                           the MLP alike
  model.norm_plus_one      every RMSNorm scales by (1 + w), w stored (and initialised) at 0
                           (Gemma: its checkpoints store w so)
  model.mlp_activation     silu: SwiGLU (Llama) | gelu_tanh: GeGLU with the tanh approximation of
                           GELU (Gemma's gelu_pytorch_tanh)
  model.scale_embeddings   the looked-up embeddings times sqrt(d_model), rounded to model.dtype
                           (Gemma; not the tied output projection)
  model.query_pre_attn_scalar   attention logits scaled by query_pre_attn_scalar ** -0.5 instead
                           of head_dim ** -0.5 (Gemma 2/3); None: head_dim

(The final logit soft cap is model.final_logits_soft_cap; per-type RoPE is the layer types',
longctx/model/layer_types.py.) The options only add parameters: with every one at its default a
block has exactly Llama's parameters, so every earlier checkpoint restores. Configs saved before a
key existed read it as its default (`options`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

QK_NORMS = ("none", "per_head", "whole")
NORM_POSITIONS = ("pre", "post", "sandwich")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")

DEFAULTS = {"qk_norm": "none", "qkv_bias": False, "norm_position": "pre", "norm_plus_one": False,
            "mlp_activation": "silu", "scale_embeddings": False, "query_pre_attn_scalar": None}


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    qk_norm: str = "none"
    qkv_bias: bool = False
    norm_position: str = "pre"
    norm_plus_one: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None

    @property
    def pre_norms(self) -> bool:
        """attn_norm and mlp_norm, the norms before the sublayers."""
        return self.norm_position in ("pre", "sandwich")

    @property
    def post_norms(self) -> bool:
        """post_attn_norm and post_mlp_norm, the norms of the sublayers' outputs."""
        return self.norm_position in ("post", "sandwich")


def options(model_config) -> BlockOptions:
    """The block options of `config.model` (a key absent from an older config: its default)."""
    return BlockOptions(**{key: model_config.get(key, default) if hasattr(model_config, "get")
                           else default for key, default in DEFAULTS.items()})


def extra_params(model_config) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    """{name: (shape, logical axes, init)} of the parameters the options add to a block, beside
    Llama's (wq, wk, wv, wo, w_gate, w_up, w_down, and attn_norm, mlp_norm where pre_norms).
    None of them is drawn at random (so Llama's parameters are drawn as without them) and none takes
    weight decay (norm gains and biases: the Llama/MaxText convention)."""
    m, o = model_config, options(model_config)
    d, n, k, h = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    gain = "zeros" if o.norm_plus_one else "ones"
    out = {}
    if o.qkv_bias:
        out.update(bq=((n, h), ("heads", "head_dim"), "zeros"), bk=((k, h), ("kv_heads", "head_dim"), "zeros"),
                   bv=((k, h), ("kv_heads", "head_dim"), "zeros"))
    if o.qk_norm == "per_head":
        out.update(q_norm=((h,), ("head_dim",), gain), k_norm=((h,), ("head_dim",), gain))
    elif o.qk_norm == "whole":
        out.update(q_norm=((n, h), ("heads", "head_dim"), gain), k_norm=((k, h), ("kv_heads", "head_dim"), gain))
    if o.post_norms:
        out.update(post_attn_norm=((d,), ("norm",), gain), post_mlp_norm=((d,), ("norm",), gain))
    return out


def is_norm(name: str) -> bool:
    """A norm gain: kept in float32 when the layer computes in a lower precision."""
    return name.endswith("norm")


def rms_norm(x, scale, eps, plus_one: bool = False):
    """RMSNorm over the last axis in float32, times `scale` (times 1 + scale with `plus_one`),
    cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    return (x32 * (1.0 + scale if plus_one else scale)).astype(x.dtype)


def norm_heads(x, scale, eps, qk_norm: str, plus_one: bool):
    """QK-norm of q or k [b, t, heads, h]: per head over h, or over the whole heads * h projection
    (scale [heads, h]); x as it is for "none"."""
    if qk_norm == "per_head":
        return rms_norm(x, scale, eps, plus_one)
    if qk_norm == "whole":
        flat = x.reshape(*x.shape[:-2], -1)
        return rms_norm(flat, scale.reshape(-1), eps, plus_one).reshape(x.shape)
    return x


def activation(name: str):
    """The gate's nonlinearity of the gated MLP."""
    return jax.nn.silu if name == "silu" else (lambda x: jax.nn.gelu(x, approximate=True))


def query_factor(model_config) -> float | None:
    """What q is multiplied by so that the kernel's head_dim ** -0.5 scales the logits by
    query_pre_attn_scalar ** -0.5; None when it is head_dim (nothing to do)."""
    scalar = options(model_config).query_pre_attn_scalar
    if scalar is None or float(scalar) == float(model_config.head_dim):
        return None
    return math.sqrt(model_config.head_dim / float(scalar))


def embed_factor(model_config) -> float | None:
    """The embeddings' scale under scale_embeddings, None for none: sqrt(d_model) rounded to
    model.dtype, as transformers' Gemma rounds it to its weights' dtype before it multiplies
    (sqrt(3840) = 61.97 is 62.0 in bfloat16)."""
    if not options(model_config).scale_embeddings:
        return None
    return float(np.asarray(math.sqrt(model_config.d_model), jnp.dtype(model_config.dtype)))
