"""The whole model's gradients in bf16 compute against float32, parameter by parameter.

With model.dtype=bfloat16 the parameters stay float32 and every activation and cotangent is
rounded to bf16 (unit roundoff u = 2^-8). Round-to-nearest errors are unbiased and independent from
one operation to the next, so along a chain of K roundings they add in quadrature: a gradient's
normwise relative error is about sqrt(K) * u / sqrt(3) (Higham & Mary, "A new approach to
probabilistic rounding error analysis", 2019), whatever the number of tokens or chunks it sums.

A sum accumulated in bf16 breaks that model: once the running sum is 2^8 times an addend, the
addend is rounded away, the same way every time; a gradient summed over n same-signed terms in bf16
loses a share that grows with n (a frequent token's embedding row, an MLP weight summed over n
chunks). The test's inputs make n large (one token is ~90% of every row; 512 MLP chunks) so that
such a sum is far outside the bound below, while a model that sums in float32 stays inside it.

The bound, per parameter tensor: ||g_bf16 - g_f32|| / ||g_f32|| <= sqrt(K) * u, with K counted
generously as every bf16 tensor a gradient's path crosses, forward and backward:
  per layer, forward: 16 activations (normed input, q, k, v, rotated q and k, attention out,
      o-projection, residual sum, normed input, gate, up, silu, product, down, residual sum)
      + 7 weights cast to bf16; backward: the 16 activations' cotangents         -> 39 per layer
  outside the layers: the embedded rows and their cotangent, the final norm's output and its
      cotangent, the hidden states' and the unembedding's bf16 copies for the logits -> 6
and (sqrt(K) rather than sqrt(K) / sqrt(3)) a margin of sqrt(3) for the amplification of the
normalised layers.
"""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from configs import base
from longctx.model.decoder import Decoder, model_nll
from longctx.parallel import mesh as mesh_lib
from tests import exhaustive_only

BF16_UNIT_ROUNDOFF = 2.0 ** -8
NUM_LAYERS = 2
ROUNDINGS_PER_LAYER = 16 + 7 + 16
ROUNDINGS_OUTSIDE_LAYERS = 6
BOUND = math.sqrt(ROUNDINGS_PER_LAYER * NUM_LAYERS + ROUNDINGS_OUTSIDE_LAYERS) * BF16_UNIT_ROUNDOFF

SEQ_LEN, BATCH, VOCAB, FREQUENT_TOKEN = 512, 4, 97, 7


def _config(dtype: str, *, tied: bool, mlp_chunk_size):
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(vocab_size=VOCAB, d_model=64, num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=128, dtype=dtype, param_dtype="float32", tie_embeddings=tied,
                   mlp_chunk_size=mlp_chunk_size, remat_policy="none")
    c.data.update(seq_len=SEQ_LEN, global_batch_size=BATCH)
    c.attention.update(impl="xla", layout="contiguous", block_size=128)
    c.train.update(loss_chunk_size=128)
    c.mesh.update(dp=1, fsdp=1, sp=1)
    return c


def _batch():
    """One document per row, ~90% of its tokens one token (the embedding row summed ~1,800 times)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ_LEN)).astype(np.int32)
    tokens[rng.random(tokens.shape) < 0.9] = FREQUENT_TOKEN
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(SEQ_LEN, dtype=np.int32), tokens.shape).copy(),
            "targets": np.roll(tokens, -1, axis=1)}


def _gradients(config, batch):
    """Every parameter's gradient of the mean NLL, as a flat {path: float64 array}; the parameters
    are the same (float32, seed 0) whatever config.model.dtype and mlp_chunk_size."""
    with jax.set_mesh(mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])):
        model = Decoder(config, layout="contiguous", rngs=nnx.Rngs(params=0))
        graphdef, params = nnx.split(model, nnx.Param)
        grads = jax.jit(jax.grad(lambda p: model_nll(nnx.merge(graphdef, p), batch).mean()))(params)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]
    return {jax.tree_util.keystr(path): np.asarray(g, np.float64) for path, g in flat}


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=exhaustive_only(
    "the untied model has every layer and head the tied one has, and an output projection"))],
    ids=["untied", "tied"])
def test_bf16_gradients_of_every_parameter_match_float32(tied):
    batch = _batch()
    assert (batch["tokens"] == FREQUENT_TOKEN).sum() > 1500
    reference = _gradients(_config("float32", tied=tied, mlp_chunk_size=None), batch)
    errors = {}
    for chunk in (None, 1):  # whole, and SEQ_LEN one-token chunks
        got = _gradients(_config("bfloat16", tied=tied, mlp_chunk_size=chunk), batch)
        assert got.keys() == reference.keys()
        for name, g in got.items():
            ref = reference[name]
            errors[f"mlp_chunk_size={chunk} {name}"] = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    report = "\n".join(f"  {name}: {e:.2e} ({e / BF16_UNIT_ROUNDOFF:.1f} u)" for name, e in errors.items())
    print(f"bound {BOUND:.2e}\n{report}")
    assert max(errors.values()) <= BOUND, f"relative gradient errors above {BOUND:.2e}:\n{report}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_initial_loss_is_near_ln_vocab(tied):
    """At init the logits should be small, so the first loss is about ln(vocab): the untied output
    projection starts at std d^-0.5 (logits ~ N(0, 0.77) on RMS-normalised hidden states, which
    adds ~0.77 / 2 nats); the tied table, which is also the output projection, must too (drawn at
    unit scale it gave logits of std ~sqrt(d_model) and a loss of ~100 nats at d_model=128)."""
    c = base.get_config("tiny")  # d_model=128, vocab 512
    c.unlock()
    c.model.tie_embeddings = tied
    c.data.seq_len = 256
    c.mesh.update(dp=1, fsdp=1, sp=1)
    tokens = np.random.default_rng(1).integers(0, c.model.vocab_size, (2, 257)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((2, 256), np.int32),
             "positions": np.broadcast_to(np.arange(256, dtype=np.int32), (2, 256)).copy()}
    with jax.set_mesh(mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:1])):
        model = Decoder(c, layout="contiguous", rngs=nnx.Rngs(params=0))
        loss = float(jax.jit(model_nll)(model, batch).mean())
    assert abs(loss - math.log(c.model.vocab_size)) <= 0.1 * math.log(c.model.vocab_size), loss
