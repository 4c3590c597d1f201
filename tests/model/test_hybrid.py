"""A hybrid model (attention.pattern) against an unrolled plain-jnp reference, logits and gradients.

Legend: b batch, s position (natural order), d model, n heads, k kv heads, h head dim, f mlp.
The pattern has a run of one type and a remainder (6 layers, period 4: local, local, global, nope,
then local, local), two RoPE thetas, a NoPE type with Llama 4's query temperature, sinks on one
type only, chunked attention on another, and a different context-parallel strategy per type (ring,
all-gather, Ulysses). The reference runs layer i with type pattern[i % 4] and row i of the one
parameter stack, on whole natural-order sequences with the dense attention oracle: the model's NLL
and every parameter's gradient match (the sinks of the layers whose type has none are unread:
their gradient is zero in both).
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.interop import hf
from longctx.model import flops, layer_types, rope
from longctx.model.decoder import Decoder, model_nll
from longctx.ops import reference_attention
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from tests import synthetic
from tests.model.test_model import plain_rms_norm, plain_rope, small_config

LAYOUT = "zigzag"
TYPES = {
    "local": dict(sliding_window=50, attention_sinks=True, rope_theta=10_000.0, cp="ring"),
    "global": dict(cp="all_gather"),
    "nope": dict(rope=False, chunk_size=96, cp="ulysses", temperature_floor=32, temperature_scale=0.5),
}


PATTERN = "local,local,global,nope"


def hybrid_config(pattern=PATTERN, num_layers=6, impl="xla"):
    c = small_config(impl=impl, layout=LAYOUT)
    c.unlock()
    c.model.num_layers = num_layers
    c.attention.pattern = pattern
    c.attention.layer_types = ml_collections.ConfigDict(TYPES)
    c.attention.block_size = 64
    c.data.seq_len = 256
    c.mesh.update(dp=1, fsdp=2, sp=4)
    return c


def plain_hybrid_nll(params, rows, config):
    """Layer by layer, each with its type's settings written out here (not read from layer_types)."""
    m = config.model
    names = config.attention.pattern.split(",")
    x = params["embed"][rows["tokens"]]
    segments, positions = jnp.asarray(rows["segment_ids"]), jnp.asarray(rows["positions"])
    for i in range(m.num_layers):
        kind = TYPES[names[i % len(names)]]
        p = jax.tree.map(lambda t, i=i: t[i], params["blocks"])
        y = plain_rms_norm(x, p["attn_norm"], m.norm_eps)
        q = jnp.einsum("bsd,dnh->bsnh", y, p["wq"])
        k = jnp.einsum("bsd,dkh->bskh", y, p["wk"])
        if kind.get("rope", True):
            theta = kind.get("rope_theta", m.rope_theta)
            q, k = plain_rope(q, positions, theta), plain_rope(k, positions, theta)
        if "temperature_floor" in kind:  # Llama 4's query scale, from the in-document position
            q = q * (1 + kind["temperature_scale"]
                     * jnp.log(1 + jnp.floor((positions + 1) / kind["temperature_floor"])))[..., None, None]
        v = jnp.einsum("bsd,dkh->bskh", y, p["wv"])
        window = kind.get("sliding_window")
        sinks = p["sinks"] if kind.get("attention_sinks") else None
        o = reference_attention(q, k, v, segments, segments, sinks, positions=positions,
                                causal=True, sliding_window=None if window is None else (window, 0),
                                chunk_size=kind.get("chunk_size"))
        x = x + jnp.einsum("bsnh,nhd->bsd", o, p["wo"])
        y = plain_rms_norm(x, p["mlp_norm"], m.norm_eps)
        x = x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"]), p["w_down"])
    x = plain_rms_norm(x, params["final_norm"], m.norm_eps)
    logp = jax.nn.log_softmax(x @ params["unembed"], -1)
    return -jnp.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]


@pytest.mark.parametrize("scan_layers,residuals", [
    (True, "save_qkv"),
    # The layer's own VJP branches on the type in its forward and its backward (model/attention.py).
    (True, "recompute_qkv"),
    pytest.param(False, "save_qkv", marks=pytest.mark.skipif(
        not os.environ.get("LONGCTX_EXHAUSTIVE"), reason="the unrolled model runs with LONGCTX_EXHAUSTIVE=1"))])
def test_hybrid_model_matches_the_unrolled_reference_forward_and_gradients(scan_layers, residuals):
    config = hybrid_config()
    config.model.scan_layers = scan_layers
    config.attention.residuals = residuals
    assert layer_types.layer_counts(6, 4) == (2, 2, 1, 1)
    assert [t.name for t in layer_types.distinct(config)] == ["local", "global", "nope"]
    assert layer_types.layer_type_indices(config).tolist() == [0, 0, 1, 2, 0, 0]
    mesh = mesh_lib.make_mesh(config.mesh)
    rows = synthetic.packed_rows(2, config.data.seq_len, config.model.vocab_size, seed=3)
    batch = synthetic.to_layout(rows, LAYOUT, 4)
    mask = jnp.asarray(rows["loss_mask"], jnp.float32)
    order = layout_lib.permutation(LAYOUT, config.data.seq_len, 4)
    with jax.set_mesh(mesh):
        model = Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0))
        model.blocks.sinks[...] = jnp.linspace(-1.0, 2.0, 24).reshape(6, 4)  # (zero-initialised)
        graphdef, params = nnx.split(model, nnx.Param)
        sharded = {k: jax.device_put(v, mesh_lib.batch_sharding(mesh)) for k, v in batch.items()}

        def model_loss(params):
            nll = model_nll(nnx.merge(graphdef, params), sharded)
            return (nll * sharded["loss_mask"]).sum(), nll

        (_, nll), grads = jax.jit(jax.value_and_grad(model_loss, has_aux=True))(params)
    pure = nnx.to_pure_dict(params)
    assert pure["blocks"]["sinks"].shape == (6, 4)  # a row for every layer, read by the local ones

    def plain_loss(pure):
        nll = plain_hybrid_nll(pure, {k: jnp.asarray(v) for k, v in rows.items()}, config)
        return (nll * mask).sum(), nll

    (_, expected), expected_grads = jax.value_and_grad(plain_loss, has_aux=True)(pure)
    assert_matches_dense_reference(nll, grads, expected, expected_grads, order, rows["loss_mask"])


def assert_matches_dense_reference(nll, grads, expected, expected_grads, order, loss_mask):
    """The model's per-token NLL (in layout `order`) and every parameter's gradient against the
    dense reference's, on the tokens the loss counts."""
    got = np.asarray(nll)[:, layout_lib.inverse_permutation(order)]
    keep = loss_mask == 1
    np.testing.assert_allclose(got[keep], np.asarray(expected)[keep], rtol=2e-4, atol=2e-4)
    flat_got = dict(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0])
    flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected_grads)[0])
    assert flat_got.keys() == flat_expected.keys()
    for path, g in flat_expected.items():
        np.testing.assert_allclose(np.asarray(flat_got[path]), np.asarray(g), rtol=2e-3, atol=2e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_a_uniform_model_keeps_its_parameter_tree_and_values():
    """No pattern: the one stack `blocks` every earlier checkpoint has, drawn as before."""
    config = small_config(impl="xla", layout=LAYOUT)
    config.mesh.update(dp=1, fsdp=2, sp=4)
    with jax.set_mesh(mesh_lib.make_mesh(config.mesh)):
        model = Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sorted(pure) == ["blocks", "embed", "final_norm", "unembed"]
    assert pure["blocks"]["wq"].shape[0] == config.model.num_layers


def test_types_resolve_from_attention_and_model_keys():
    config = hybrid_config()
    local, global_, nope, local_again = (layer_types.resolve(config, name)
                                         for name in ("local", "global", "nope", "local"))
    assert local.attention.sliding_window == 50 and local.attention.attention_sinks
    assert global_.attention.sliding_window is None and global_.attention.cp == "all_gather"
    assert global_.attention.block_size == config.attention.block_size  # inherited
    assert nope.rotary is None and local.rotary is not None
    assert nope.temperature == (32, 0.5) and local.temperature is None
    np.testing.assert_array_equal(local.rotary.inv_freq, local_again.rotary.inv_freq)
    assert not np.array_equal(local.rotary.inv_freq, global_.rotary.inv_freq)  # two thetas
    assert "pattern" not in local.attention and "layer_types" not in local.attention
    assert [layer_types.type_of_layer(config, i) for i in range(6)] == [
        "local", "local", "global", "nope", "local", "local"]


@pytest.mark.parametrize("change, message", [
    (dict(pattern="local,wide"), "attention.pattern names layer type 'wide', which attention.layer_types "
                                 "does not define (defined: global, local, nope)"),
    (dict(types={"local": dict(window=3)}), "attention.layer_types.local.window is not a key a layer type sets"),
    (dict(types={"local": dict(sliding_window=0)}), "attention.layer_types.local.sliding_window=0 must be positive."),
    (dict(types={"nope": dict(chunk_size=-4)}), "attention.layer_types.nope.chunk_size=-4 must be positive."),
    (dict(types={"global": dict(cp="ulysses_ring")}), "attention.layer_types.global.cp='ulysses_ring' is not one of"),
    (dict(types={"global": dict(block_size=96)}), "attention.layer_types.global.block_size=96 does not divide"),
    (dict(types={"local": dict(logits_soft_cap=-1.0)}), "attention.layer_types.local.logits_soft_cap=-1.0 must be positive."),
    (dict(types={"global": dict(rope_scaling=dict(type="linear", factor=0.5))}),
     "attention.layer_types.global.rope_scaling.factor=0.5 must be at least 1 for linear RoPE scaling."),
])
def test_validate_names_the_type_and_key_of_a_bad_setting(change, message):
    config = hybrid_config()
    if "pattern" in change:
        config.attention.pattern = change["pattern"]
    for name, settings in change.get("types", {}).items():
        config.attention.layer_types[name] = ml_collections.ConfigDict(settings)
    with pytest.raises(ConfigError) as e:
        config_lib.validate(config, num_devices=8)
    assert str(e.value).startswith(message), str(e.value)


def test_validate_accepts_the_hybrid_config():
    config_lib.validate(hybrid_config(), num_devices=8)


def test_a_hybrid_hugging_face_cannot_express_is_refused_for_export_in_one_sentence():
    """(Sinks on a layer type; Gemma 3 and OLMo 3 patterns export: tests/interop/test_families.py.)"""
    with pytest.raises(ConfigError, match=r"^attention.layer_types.local.attention_sinks has no Hugging Face "
                       r"equivalent; this model cannot be exported\.$"):
        hf.export_config(hybrid_config(), np.float32)


def test_the_parameter_estimate_and_attention_flops_count_each_type():
    config = hybrid_config()
    model = nnx.eval_shape(lambda: Decoder(config, layout=LAYOUT, rngs=nnx.Rngs(params=0)))
    counted = sum(np.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert config_lib.num_params_estimate(config) == counted
    m, d = config.model, config.data
    pairs = sum(flops.kept_pairs(d.seq_len, causal=True, sliding_window=TYPES[name].get("sliding_window"),
                                 chunk_size=TYPES[name].get("chunk_size"))
                for name in ("local", "local", "global", "nope", "local", "local"))
    assert flops.attention_flops_per_step(config) == 12.0 * d.global_batch_size * m.num_heads * m.head_dim * pairs


def test_a_type_s_rope_scaling_takes_the_model_s_other_keys():
    config = hybrid_config()
    config.attention.layer_types["global"] = ml_collections.ConfigDict(
        dict(rope_scaling=dict(type="linear", factor=8.0)))
    scaled, plain = layer_types.resolve(config, "global"), layer_types.resolve(config, "local")
    unscaled = rope.plain_inv_freq(config.model.head_dim, config.model.rope_theta)
    np.testing.assert_allclose(scaled.rotary.inv_freq, unscaled / 8, rtol=1e-6)
    assert layer_types.rope_scaling(config, "global")["original_max_position"] == 8192  # the model's
    assert plain.rotary is not None and layer_types.rope_scaling(config, "local")["type"] == "none"


def test_layer_types_compare_by_value():
    """The blocks' graph definitions (which hold their layer type) are compared by jax and flax
    when a program is traced again: two resolutions of one type are equal and hash alike."""
    config = hybrid_config()
    first, again = layer_types.resolve(config, "local"), layer_types.resolve(config, "local")
    assert first.rotary is not again.rotary and first.rotary == again.rotary
    assert hash(first.rotary) == hash(again.rotary) and first == again
    assert first != layer_types.resolve(config, "global")
