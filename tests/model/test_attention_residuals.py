"""What the backward keeps: every attention.residuals policy gives the gradients of the ring's own
VJP (save_qkv), recompute_qkv keeps less per layer, and the MLP in chunks is the same MLP."""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from longctx.parallel import mesh as mesh_lib
from longctx.plan import aot
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from tests import ROOT, synthetic

sys.path.insert(0, ROOT)
from configs import base as base_config  # noqa: E402


def _config(policy, mlp_chunk_size=None, **attention):
    c = base_config.get_config("tiny")
    c.model.mlp_chunk_size = mlp_chunk_size
    c.mesh.dp, c.mesh.fsdp, c.mesh.sp = 1, 2, 4
    c.model.num_layers = 2
    c.data.seq_len, c.data.global_batch_size = 512, 2
    c.attention.update(**{"block_size": 64, "residuals": policy, **attention})
    c.train.loss_chunk_size = 64
    return c


ROWS = synthetic.packed_rows(2, 512, 97, seed=5, mean_doc_len=150)
ATTENTION_CASES = {"sinks": dict(attention_sinks=True),
                   "chunks_splash": dict(chunk_size=96, layout="contiguous", impl="splash", block_size=128)}


@functools.lru_cache(maxsize=None)
def _result(policy: str, case: str, mlp_chunk_size=None):
    """(loss, grads) of one train-step gradient on ROWS; each setting is compiled once per session."""
    return _loss_and_grads(_config(policy, mlp_chunk_size, **ATTENTION_CASES[case]), ROWS)


def _loss_and_grads(config, rows):
    mesh = mesh_lib.make_mesh(config.mesh)
    layout = train_state.resolve_layout(config, mesh.shape[mesh_lib.SP])
    setup = train_state.make_setup(config, mesh, layout)
    state = setup.init(jax.random.PRNGKey(0))
    batch = {k: jax.device_put(np.asarray(rows[k], np.int32), setup.batch_sharding)
             for k in train_steps.BATCH_KEYS}
    with jax.set_mesh(mesh):
        loss_fn = lambda params, batch: train_steps._masked_loss(setup.graphdef, params, batch)  # noqa: E731
        (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state.params, batch)
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def _assert_same(got_result, want_result, rtol=1e-5):
    (got_loss, got), (want_loss, want) = got_result, want_result
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert_trees_close(got, want, rtol)


def assert_trees_close(got, want, rtol: float):
    """Every leaf of `got` within `rtol` of the largest magnitude of `want`'s (none all zero)."""
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = flat_want[path]
        assert np.any(w != 0), jax.tree_util.keystr(path)
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: {err:.2e}"


# Each policy once, each attention case once (both pairings with LONGCTX_EXHAUSTIVE=1).
POLICY_CASES = [("recompute_qkv", "chunks_splash"), ("offload_qkv", "sinks")]
if os.environ.get("LONGCTX_EXHAUSTIVE"):
    POLICY_CASES += [("recompute_qkv", "sinks"), ("offload_qkv", "chunks_splash")]


@pytest.mark.parametrize("policy,case", POLICY_CASES)
def test_policy_gradients_equal_the_rings_own(policy, case):
    _assert_same(_result(policy, case), _result("save_qkv", case))
    if case == "sinks":
        assert any("sinks" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(_result(policy, case)[1]))


@pytest.mark.parametrize("policy", ["save_qkv", "recompute_qkv"])
def test_mlp_in_chunks_is_the_same_mlp(policy):
    """128 tokens per device in chunks of 32 (4 chunks per shard, under the layer scan and, for
    recompute_qkv, inside the layer's own VJP) against the whole shard at once."""
    _assert_same(_result(policy, "sinks", mlp_chunk_size=32), _result(policy, "sinks"))


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_recompute_keeps_less_than_saving_on_tpu():
    """The TPU compiler's own memory figure: recompute_qkv needs fewer temporaries than save_qkv
    for a long sequence (what the backward keeps per layer dominates them). 8,192 tokens, 1,024
    per chip, two 512-token blocks: 3.8 MB saved against 1.0 MB asked; at 16,384 and 65,536 tokens
    the margin is the same in proportion (8.3 MB against 2.1 MB, 33 MB against 8 MB) and the
    compiles take longer (21 s for the two at 16,384, against 16 s here)."""
    def temp_bytes(policy):
        c = base_config.get_config("tiny")
        c.mesh.update(dp=1, fsdp=1, sp=8)
        c.model.update(num_layers=4, remat_policy="nothing_saveable", dtype="bfloat16")
        c.attention.update(impl="splash", block_size=512, residuals=policy)
        c.data.update(seq_len=8192, global_batch_size=1)
        c.train.loss_chunk_size = 1024
        return aot.compile_train_step(c, "v5p:2x2x2").temp_bytes

    saved, recomputed = temp_bytes("save_qkv"), temp_bytes("recompute_qkv")
    # q, k, v per token per layer: (4 + 2 + 2) heads x 32 x 2 bytes; 4 layers x 1,024 tokens.
    qkv_bytes = (4 + 2 * 2) * 32 * 2 * 4 * 1024
    assert recomputed <= saved - qkv_bytes // 2, f"temporaries: save_qkv {saved}, recompute_qkv {recomputed}"
