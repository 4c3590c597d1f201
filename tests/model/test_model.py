"""The decoder's forward pass against an independent plain-jnp version of the same equations.

Legend: b batch, s position (natural order), d model, n heads, k kv heads, h head dim, f mlp, v vocab.
The plain version works on whole natural-order sequences with the dense attention oracle; the model
works on layout-ordered shards around the ring. Matching per-token NLL proves the layout, RoPE from
packed positions, segment masking, GQA, sinks and the chunked loss all line up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from longctx.model.decoder import Decoder, model_nll, token_nll
from longctx.ops import reference_attention
from longctx.parallel import document_layout
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from tests import synthetic


def small_config(**attention):
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(vocab_size=97, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=96, dtype="float32")
    c.data.update(seq_len=512, global_batch_size=2)
    c.attention.update(block_size=128, **attention)
    c.train.update(loss_chunk_size=64)
    return c


def plain_rms_norm(x, scale, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def plain_rope(x, positions, theta):
    h = x.shape[-1]
    freq = theta ** (-jnp.arange(0, h, 2) / h)
    ang = positions[..., None, None] * freq  # [b, s, 1, h/2]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def plain_nll(params, rows, config):
    m, a = config.model, config.attention
    x = params["embed"][rows["tokens"]]
    segments = jnp.asarray(rows["segment_ids"]) if a.use_segment_ids else None
    # Without the document mask the row is one sequence: RoPE and chunks on row positions.
    positions = (rows["positions"] if a.use_segment_ids
                 else jnp.broadcast_to(jnp.arange(rows["tokens"].shape[1]), rows["tokens"].shape))
    blocks = params["blocks"]
    for i in range(m.num_layers):
        p = jax.tree.map(lambda t: t[i], blocks)
        y = plain_rms_norm(x, p["attn_norm"], m.norm_eps)
        q = plain_rope(jnp.einsum("bsd,dnh->bsnh", y, p["wq"]), positions, m.rope_theta)
        k = plain_rope(jnp.einsum("bsd,dkh->bskh", y, p["wk"]), positions, m.rope_theta)
        v = jnp.einsum("bsd,dkh->bskh", y, p["wv"])
        o = reference_attention(q, k, v, segments, segments, p.get("sinks"),
                                positions=jnp.asarray(positions), causal=a.causal,
                                sliding_window=None if a.sliding_window is None else (a.sliding_window, 0),
                                chunk_size=a.chunk_size, logits_soft_cap=a.logits_soft_cap)
        x = x + jnp.einsum("bsnh,nhd->bsd", o, p["wo"])
        y = plain_rms_norm(x, p["mlp_norm"], m.norm_eps)
        x = x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"]), p["w_down"])
    x = plain_rms_norm(x, params["final_norm"], m.norm_eps)
    logits = x @ (params["embed"].T if params.get("unembed") is None else params["unembed"])
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]


@pytest.mark.parametrize("impl, layout, attention", [
    ("xla", "zigzag", dict(causal=True)),
    ("xla", "striped", dict(causal=True, sliding_window=100, attention_sinks=True)),
    ("xla", "contiguous", dict(causal=True, chunk_size=192, logits_soft_cap=20.0)),
    ("splash", "zigzag", dict(causal=True, attention_sinks=True)),
    # the "no document mask" ablation: one sequence per row, row positions in a non-trivial layout
    ("xla", "striped", dict(causal=True, use_segment_ids=False, chunk_size=192)),
    # each row its own permutation, the segment ids renumbered (parallel/document_layout.py)
    ("xla", "per_document", dict(causal=True, chunk_size=192, attention_sinks=True)),
    ("splash", "per_document", dict(causal=True, sliding_window=100, logits_soft_cap=20.0)),
])
def test_forward_matches_plain_jnp(impl, layout, attention):
    config = small_config(impl=impl, layout=layout, **attention)
    config.mesh.update(dp=1, fsdp=2, sp=4)
    mesh = mesh_lib.make_mesh(config.mesh)
    rows = synthetic.packed_rows(2, config.data.seq_len, config.model.vocab_size, seed=3)
    if layout_lib.per_row(layout):
        batch, perm = document_layout.permute_rows(rows, 4, config.attention.block_size)
    else:
        perm = np.broadcast_to(layout_lib.permutation(layout, 512, 4), rows["tokens"].shape)
        batch = synthetic.to_layout(rows, layout, 4)
    with jax.set_mesh(mesh):
        model = Decoder(config, layout=layout, rngs=nnx.Rngs(params=0))
        if config.attention.attention_sinks:  # zero-initialised: make them matter
            model.blocks.sinks[...] = jnp.linspace(-1.0, 2.0, 8).reshape(2, 4)
        sharded = {k: jax.device_put(v, mesh_lib.batch_sharding(mesh)) for k, v in batch.items()}
        nll = jax.jit(model_nll)(model, sharded)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    expected = plain_nll(params, {k: jnp.asarray(v) for k, v in rows.items()}, config)
    got_natural = np.take_along_axis(np.asarray(nll), np.argsort(perm, axis=1), axis=1)
    mask = rows["loss_mask"] == 1
    np.testing.assert_allclose(got_natural[mask], np.asarray(expected)[mask], rtol=2e-4, atol=2e-4)


def test_loss_in_low_precision_rounds_only_the_operands():
    """bf16 compute: the hidden states and unembedding are rounded to bf16, nothing after them.

    Reference: the float32 loss of the same bf16-rounded operands. The logits are float32
    products (rounding them to bf16 first moved single tokens' NLL by ~6e-2 at |logit| ~ 20), and
    the unembedding's gradient is summed over the loss chunks in float32, so its error stays one
    bf16 rounding (2^-8) of the largest entry, however many chunks there are."""
    rng = np.random.default_rng(0)
    b, s, d, v = 2, 512, 64, 4096
    h = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)) * 4 / np.sqrt(d), jnp.float32)  # logits ~ N(0, 16)
    y = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    c = small_config()
    c.mesh.update(dp=1, fsdp=1, sp=1)

    def nll(h, w, dtype):
        return token_nll(h.astype(dtype), w, y, chunk_size=32, soft_cap=None, dtype=dtype)

    def loss(h, w, dtype):
        return nll(h, w, dtype).mean()

    rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in (h, w)]
    with jax.set_mesh(mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:1])):
        ref_nll = nll(*rounded, jnp.float32)
        ref_dw = jax.grad(loss, argnums=1)(*rounded, jnp.float32)
        got_nll = jax.jit(nll, static_argnums=2)(h, w, jnp.bfloat16)
        got_dw = jax.jit(jax.grad(loss, argnums=1), static_argnums=2)(h, w, jnp.bfloat16)
    assert got_nll.dtype == jnp.float32 and got_dw.dtype == jnp.float32
    np.testing.assert_allclose(got_nll, ref_nll, rtol=0, atol=1e-4)
    assert float(jnp.abs(got_dw - ref_dw).max()) <= 2 ** -8 * float(jnp.abs(ref_dw).max())
