"""Training with each context-parallel strategy (attention.cp) is the ring's training: the same
losses, step by step, over 20 steps of the tiny model on 8 devices, packed documents included."""

import jax
import numpy as np
import pytest

from configs import base
from longctx.parallel import mesh as mesh_lib
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from tests import synthetic

STEPS, SEQ_LEN, VOCAB = 20, 512, 97


def _config(**attention):
    c = base.get_config("tiny")
    c.unlock()
    c.mesh.update(dp=1, fsdp=2, sp=4)
    # 4 query heads, 2 KV heads: Ulysses over sp=4 sends each KV head to two devices.
    c.model.update(vocab_size=VOCAB, d_model=64, num_layers=1, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=96, dtype="float32", attention_sinks=True)
    c.data.update(seq_len=SEQ_LEN, global_batch_size=2)
    c.attention.update(impl="xla", layout="zigzag", block_size=64, sliding_window=200, **attention)
    c.train.update(loss_chunk_size=64, num_steps=100)
    c.optimizer.update(learning_rate=1e-2, warmup_steps=0)
    return c


def _losses(config):
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices())
    layout = train_state.resolve_layout(config, mesh.shape["sp"])
    losses = []
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, layout)
        state = setup.init(jax.random.PRNGKey(0))
        train_step, _ = train_steps.jit_steps(config, setup)
        for step in range(STEPS):
            rows = synthetic.packed_rows(2, SEQ_LEN, VOCAB, seed=step, mean_doc_len=150)
            batch = {k: jax.device_put(v, setup.batch_sharding)
                     for k, v in synthetic.to_layout(rows, layout, mesh.shape["sp"]).items()}
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def ring_losses():
    return _losses(_config())


@pytest.mark.parametrize("strategy", [dict(cp="all_gather"), dict(cp="ulysses"),
                                      dict(cp="usp", cp_ulysses=2), dict(cp="halo")],
                         ids=lambda s: s["cp"])
def test_strategy_trains_as_the_ring(ring_losses, strategy):
    losses = _losses(_config(**strategy))
    assert losses[-1] < losses[0] - 0.2  # it trains (random tokens: towards their unigram entropy)
    # float32 noise: the strategies sum the same blocks in another order
    np.testing.assert_allclose(losses, ring_losses, rtol=2e-5)
