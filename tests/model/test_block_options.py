"""The families' block options (model.qk_norm, qkv_bias, norm_position, norm_plus_one,
mlp_activation, scale_embeddings, query_pre_attn_scalar) against a dense plain-jnp reference.

Legend: b batch, s position (natural order), d model, n heads, k kv heads, h head dim, f mlp.
The reference writes each family's block out from its definition (transformers' Qwen2, Qwen3,
OLMo 3 and Gemma 3 layers), without reading longctx/model/block_options.py, on whole natural-order
sequences with the dense attention oracle; the model runs around the ring in the zigzag layout.
Zero-initialised parameters (biases, (1 + w) gains) are set to random values first, so each
option changes the output.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.model import block_options
from longctx.model.decoder import Decoder, model_nll, weight_decay_mask
from longctx.ops import reference_attention
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from tests import synthetic
from tests.model.test_hybrid import assert_matches_dense_reference
from tests.model.test_model import plain_rope, small_config

LAYOUT = "zigzag"
LLAMA_BLOCK = ["attn_norm", "mlp_norm", "w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]


def norm(x, w, eps, plus_one):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * ((1.0 + w) if plus_one else w)


def plain_nll(params, rows, config):
    m = config.model
    o = {key: m[key] for key in block_options.DEFAULTS}
    one = o["norm_plus_one"]
    x = params["embed"][rows["tokens"]]
    if o["scale_embeddings"]:
        x = x * np.sqrt(m.d_model)
    segments, positions = jnp.asarray(rows["segment_ids"]), jnp.asarray(rows["positions"])
    for i in range(m.num_layers):
        p = jax.tree.map(lambda t: t[i], params["blocks"])
        y = norm(x, p["attn_norm"], m.norm_eps, one) if o["norm_position"] != "post" else x
        q = jnp.einsum("bsd,dnh->bsnh", y, p["wq"])
        k = jnp.einsum("bsd,dkh->bskh", y, p["wk"])
        v = jnp.einsum("bsd,dkh->bskh", y, p["wv"])
        if o["qkv_bias"]:  # Qwen2: q_proj/k_proj/v_proj with bias=True
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if o["qk_norm"] == "per_head":  # Qwen3 / Gemma 3: q_norm(q.view(heads)) over head_dim
            q, k = norm(q, p["q_norm"], m.norm_eps, one), norm(k, p["k_norm"], m.norm_eps, one)
        elif o["qk_norm"] == "whole":  # OLMo 3: q_norm(q_proj(x)) over heads * head_dim
            b, s = q.shape[:2]
            q = norm(q.reshape(b, s, -1), p["q_norm"].reshape(-1), m.norm_eps, one).reshape(q.shape)
            k = norm(k.reshape(b, s, -1), p["k_norm"].reshape(-1), m.norm_eps, one).reshape(k.shape)
        q, k = plain_rope(q, positions, m.rope_theta), plain_rope(k, positions, m.rope_theta)
        scalar = o["query_pre_attn_scalar"]
        o_ = reference_attention(q, k, v, segments, segments, None, positions=positions, causal=True,
                                 softmax_scale=None if scalar is None else scalar ** -0.5)
        attended = jnp.einsum("bsnh,nhd->bsd", o_, p["wo"])
        if o["norm_position"] != "pre":
            attended = norm(attended, p["post_attn_norm"], m.norm_eps, one)
        x = x + attended
        y = norm(x, p["mlp_norm"], m.norm_eps, one) if o["norm_position"] != "post" else x
        gate = y @ p["w_gate"]
        gate = (jax.nn.silu(gate) if o["mlp_activation"] == "silu"
                else 0.5 * gate * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))))
        mlp = jnp.einsum("bsf,fd->bsd", gate * (y @ p["w_up"]), p["w_down"])
        if o["norm_position"] != "pre":
            mlp = norm(mlp, p["post_mlp_norm"], m.norm_eps, one)
        x = x + mlp
    x = norm(x, params["final_norm"], m.norm_eps, one)
    logp = jax.nn.log_softmax(x @ params["unembed"], -1)
    return -jnp.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]


def options_config(**options):
    config = small_config(impl="xla", layout=LAYOUT)
    config.attention.residuals = options.pop("residuals", "save_qkv")
    config.model.update(**options)
    config.data.seq_len = 256
    config.attention.block_size = 64
    config.mesh.update(dp=1, fsdp=2, sp=4)
    return config


def randomised(model):
    """Every parameter the options add set to random values (they start at 0 or 1)."""
    rng = np.random.default_rng(1)
    for name in ("bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm",
                 "attn_norm", "mlp_norm"):
        param = getattr(model.blocks, name, None)
        if param is not None:
            param[...] = param[...] + jnp.asarray(0.3 * rng.standard_normal(param[...].shape), jnp.float32)
    model.final_norm[...] = model.final_norm[...] + jnp.asarray(
        0.3 * rng.standard_normal(model.final_norm[...].shape), jnp.float32)
    return model


CASES = {
    "qwen2_bias": dict(qkv_bias=True),
    "qwen3_qk_norm": dict(qk_norm="per_head"),
    "olmo_qk_norm_whole": dict(qk_norm="whole"),
    "olmo_post_norms": dict(norm_position="post"),
    "sandwich_norms": dict(norm_position="sandwich"),
    "plus_one_gains": dict(norm_plus_one=True),
    "geglu": dict(mlp_activation="gelu_tanh"),
    "embedding_scale": dict(scale_embeddings=True),
    "query_scale": dict(query_pre_attn_scalar=64.0),
    "gemma3_block": dict(qk_norm="per_head", norm_position="sandwich", norm_plus_one=True,
                         mlp_activation="gelu_tanh", scale_embeddings=True, query_pre_attn_scalar=24.0),
    "olmo3_block": dict(qk_norm="whole", norm_position="post"),
    # the options' parameters through the layer's own VJP (q, k, v recomputed in the backward)
    "gemma3_block_recompute_qkv": dict(qk_norm="per_head", norm_position="sandwich", norm_plus_one=True,
                                       mlp_activation="gelu_tanh", qkv_bias=True, residuals="recompute_qkv"),
}


# Three blocks cover every option (~20 s each to compile on 2 cores): Gemma 3's (Qwen3's per-head
# QK-norm among them), OLMo 3's, and Gemma 3's with Qwen2's q/k/v biases under recompute_qkv; each
# option alone, and the Qwen blocks, run with LONGCTX_EXHAUSTIVE=1.
FAMILIES = ("gemma3_block", "olmo3_block", "gemma3_block_recompute_qkv")


@pytest.mark.parametrize("case", [case if case in FAMILIES else pytest.param(case, marks=pytest.mark.skipif(
    not os.environ.get("LONGCTX_EXHAUSTIVE"), reason="each option alone runs with LONGCTX_EXHAUSTIVE=1"))
    for case in CASES])
def test_block_option_matches_the_dense_reference(case):
    config = options_config(**CASES[case])
    config_lib.validate(config, num_devices=8)
    mesh = mesh_lib.make_mesh(config.mesh)
    rows = synthetic.packed_rows(2, config.data.seq_len, config.model.vocab_size, seed=3)
    batch = synthetic.to_layout(rows, LAYOUT, 4)
    mask = jnp.asarray(rows["loss_mask"], jnp.float32)
    with jax.set_mesh(mesh):
        model = randomised(Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0)))
        graphdef, params = nnx.split(model, nnx.Param)
        sharded = {k: jax.device_put(v, mesh_lib.batch_sharding(mesh)) for k, v in batch.items()}

        def model_loss(params):
            nll = model_nll(nnx.merge(graphdef, params), sharded)
            return (nll * sharded["loss_mask"]).sum(), nll

        (_, nll), grads = jax.jit(jax.value_and_grad(model_loss, has_aux=True))(params)
    pure = nnx.to_pure_dict(params)

    def plain_loss(pure):
        nll = plain_nll(pure, {k: jnp.asarray(v) for k, v in rows.items()}, config)
        return (nll * mask).sum(), nll

    (_, expected), expected_grads = jax.value_and_grad(plain_loss, has_aux=True)(pure)
    assert_matches_dense_reference(nll, grads, expected, expected_grads,
                                   layout_lib.permutation(LAYOUT, 256, 4), rows["loss_mask"])


@pytest.mark.parametrize("d_model, dtype, scale", [
    (3840, "bfloat16", 62.0), (3840, "float32", np.float32(np.sqrt(3840))),  # Gemma 3 12B: 61.97
    (48, "bfloat16", 6.9375), (64, "bfloat16", 8.0)])
def test_the_embedding_scale_is_rounded_to_the_compute_dtype(d_model, dtype, scale):
    """transformers' Gemma multiplies the embeddings by sqrt(d_model) as a tensor of its weights'
    dtype: in bfloat16, 62.0 for d_model 3840, not 61.97."""
    config = options_config(scale_embeddings=True)
    config.model.update(d_model=d_model, dtype=dtype)
    assert block_options.embed_factor(config.model) == scale


def test_the_decoder_scales_its_embeddings_by_the_rounded_factor():
    """The decoder's own program multiplies by bfloat16's sqrt(48) = 6.9375, not 6.9282."""
    config = options_config(scale_embeddings=True)
    config.model.update(d_model=48, dtype="bfloat16")
    tokens = jnp.zeros((2, config.data.seq_len), jnp.int32)
    with jax.set_mesh(mesh_lib.make_mesh(config.mesh)):
        model = Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0))
        program = str(jax.make_jaxpr(lambda t: model(t, t, t + 1))(tokens))
    assert "6.9375" in program and "6.928" not in program


def test_every_option_at_its_default_is_llamas_block():
    """Not one parameter more or less (every earlier checkpoint restores: tests/train/
    test_checkpoint_format.py restores the 2373a90 fixture)."""
    config = options_config()
    with jax.set_mesh(mesh_lib.make_mesh(config.mesh)):
        model = Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sorted(pure) == ["blocks", "embed", "final_norm", "unembed"]
    assert sorted(pure["blocks"]) == LLAMA_BLOCK
    assert config_lib.num_params_estimate(config) == sum(x.size for x in jax.tree.leaves(pure))


def test_the_options_parameters_carry_axes_and_no_weight_decay():
    config = options_config(**CASES["gemma3_block"], qkv_bias=True)
    with jax.set_mesh(mesh_lib.make_mesh(config.mesh)):
        model = Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0))
    state = nnx.state(model, nnx.Param)
    decay = nnx.to_pure_dict(weight_decay_mask(state))["blocks"]
    blocks = nnx.to_pure_dict(state)["blocks"]
    added = ["bk", "bq", "bv", "k_norm", "post_attn_norm", "post_mlp_norm", "q_norm"]
    assert sorted(set(blocks) - set(LLAMA_BLOCK)) == added
    assert not any(decay[name] for name in added + ["attn_norm", "mlp_norm"])
    assert all(decay[name] for name in ("wq", "w_gate"))
    axes = {name: getattr(model.blocks, name).get_metadata()["out_sharding"] for name in added}
    assert axes["bq"] == ("layers", "heads", "head_dim") and axes["bk"] == ("layers", "kv_heads", "head_dim")
    assert axes["q_norm"] == ("layers", "head_dim") and axes["post_mlp_norm"] == ("layers", "norm")
    # (1 + w) gains start at w = 0: the block starts as Llama's with unit gains
    assert float(jnp.abs(blocks["q_norm"]).max()) == 0.0 and float(jnp.abs(model.final_norm[...]).max()) == 0.0
    assert config_lib.num_params_estimate(config) == sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(state)))


@pytest.mark.parametrize("key, value, message", [
    ("qk_norm", "per_layer", r"^model.qk_norm='per_layer' is not one of 'none', 'per_head', 'whole'\.$"),
    ("norm_position", "after", r"^model.norm_position='after' is not one of 'pre', 'post', 'sandwich'\.$"),
    ("mlp_activation", "gelu", r"^model.mlp_activation='gelu' is not one of 'silu', 'gelu_tanh'\.$"),
    ("query_pre_attn_scalar", -1.0, r"^model.query_pre_attn_scalar=-1.0 must be a positive number"),
])
def test_a_bad_option_is_one_sentence(key, value, message):
    config = options_config(**{key: value})
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(config, num_devices=8)


def test_a_config_saved_before_the_options_reads_them_as_llamas():
    config = options_config()
    config.unlock()
    for key in block_options.DEFAULTS:
        del config.model[key]
    assert block_options.options(config.model) == block_options.BlockOptions()
    config_lib.validate(config, num_devices=8)
