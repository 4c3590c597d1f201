"""Gradient accumulation (train.grad_accum_steps): the batch split into micro-batches scanned inside
the step gives the one-pass step's loss, loss tokens, gradients and update on the same rows, in float32,
documents and padding included; the eval step's sums too; a batch that does not split is one
sentence."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.parallel import mesh as mesh_lib
from longctx.plan import memory_model
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from tests import synthetic
from tests.model.test_attention_residuals import assert_trees_close


def _config(accum: int, sp: int = 4):
    c = base.get_config("tiny")
    c.unlock()
    c.mesh.update(dp=1, fsdp=2, sp=sp)
    c.model.update(vocab_size=97, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=96, dtype="float32")
    c.data.update(seq_len=512, global_batch_size=8)
    c.attention.update(impl="xla", layout="zigzag", block_size=64)
    c.train.update(loss_chunk_size=64, grad_accum_steps=accum)
    c.optimizer.update(learning_rate=1e-2, warmup_steps=0, eps=1e-3)
    return c


ROWS = synthetic.packed_rows(8, 512, 97, seed=4, mean_doc_len=90)  # documents, some rows padded


def _step(accum: int):
    """(metrics, gradients, the parameters after the update, eval sums) of one step on ROWS, on two
    devices (fsdp=2; test_micro_batches_... checks the split on the whole mesh)."""
    config = _config(accum, sp=1)
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "zigzag")
        state = setup.init(jax.random.PRNGKey(0))
        batch = {k: jax.device_put(v, setup.batch_sharding) for k, v in synthetic.to_layout(ROWS, "zigzag", 1).items()}
        grads = jax.jit(lambda p, b: train_steps._loss_and_grads(setup.graphdef, p, b, accum,
                                                                 setup.state_shardings.params)[2])(state.params, batch)
        train_step, eval_step = train_steps.jit_steps(config, setup)
        sums = jax.device_get(eval_step(state.params, batch))
        state, metrics = train_step(state, batch)
    return (jax.device_get(metrics), jax.tree.map(np.asarray, nnx.to_pure_dict(grads)),
            jax.tree.map(np.asarray, nnx.to_pure_dict(state.params)), sums)


def test_accumulated_step_is_the_one_pass_step():
    """4 micro-batches of 2 rows (one per fsdp rank) against the 8 rows at once: the same loss,
    gradients and update (AdamW's eps is 1e-3, as in tests/train/test_train.py, so that the update
    is a smooth function of the gradient)."""
    (one_metrics, one_grads, one_params, one_sums), (acc_metrics, acc_grads, acc_params, acc_sums) = _step(1), _step(4)
    assert acc_metrics["loss_tokens"] == one_metrics["loss_tokens"] == ROWS["loss_mask"].sum()
    assert acc_metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-6)
    assert acc_metrics["grad_norm"] == pytest.approx(one_metrics["grad_norm"], rel=1e-6)
    assert_trees_close(acc_grads, one_grads, rtol=1e-5)
    assert_trees_close(acc_params, one_params, rtol=1e-6)
    np.testing.assert_allclose(acc_sums["nll_sum"], one_sums["nll_sum"], rtol=1e-6)
    np.testing.assert_array_equal(acc_sums["count_by_position"], one_sums["count_by_position"])
    np.testing.assert_allclose(acc_sums["nll_by_position"], one_sums["nll_by_position"], rtol=1e-5)


def test_micro_batches_take_every_row_once_without_moving_it():
    """Micro-batch k holds rows k, k + A, ...: each fsdp rank's rows split among the micro-batches."""
    config = _config(4)
    mesh = mesh_lib.make_mesh(config.mesh)
    rows = np.arange(8 * 512, dtype=np.int32).reshape(8, 512)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "zigzag")
        batch = {"x": jax.device_put(rows, setup.batch_sharding)}
        micro = jax.jit(lambda b: train_steps.micro_batches(b, 4))(batch)["x"]
    np.testing.assert_array_equal(np.asarray(micro), rows.reshape(2, 4, 512).swapaxes(0, 1))
    held = {shard.device: set(np.asarray(shard.data).ravel()) for shard in batch["x"].addressable_shards}
    for shard in micro.addressable_shards:  # every device's micro-batches hold its own tokens
        assert set(np.asarray(shard.data).ravel()) == held[shard.device]


def test_a_batch_that_does_not_split_is_one_sentence():
    config = _config(3)
    with pytest.raises(ConfigError) as error:
        config_lib.validate(config, num_devices=8)
    assert str(error.value) == (
        "data.global_batch_size=8 does not split into train.grad_accum_steps=3 micro-batches of whole rows "
        "for each of dp*fsdp = 2 data-parallel ranks: set --config.data.global_batch_size=12 or a "
        "train.grad_accum_steps that divides 4.")
    config.train.grad_accum_steps = 0
    with pytest.raises(ConfigError, match=r"^train.grad_accum_steps=0 must be a whole number of micro-batches"):
        config_lib.validate(config, num_devices=8)


def test_the_memory_model_holds_one_micro_batch():
    """Activations are one micro-batch's; the float32 sum of the gradients and the sum it adds to
    are two more copies (as the compiler counts them)."""
    sizes = {"dp": 1, "fsdp": 2, "sp": 4}
    one, four = (memory_model.per_device_bytes(_config(a), sizes) for a in (1, 4))
    assert four.saved_bytes * 4 == one.saved_bytes
    assert four.working_bytes < one.working_bytes
    assert four.gradient_bytes - one.gradient_bytes == 2 * config_lib.num_params_estimate(_config(1)) * 4 / 8


@pytest.mark.parametrize("accum, advice", [(1, "(rows per device 4 -> 2)"),
                                           (2, "(rows per device per micro-batch 2 -> 1)"),
                                           (4, None)])
def test_estimates_remedy_halves_the_batch_only_where_a_micro_batch_holds_rows(accum, advice):
    """8 rows over dp x fsdp = 2: 4 per device. The activations are one micro-batch's, so halving
    the batch saves memory only while a micro-batch holds more than one row per device."""
    from longctx.plan import aot
    over = aot.CompiledStep(topology="v5p:1x1x2", device_kind="TPU v5", num_devices=8,
                            mesh_shape={"dp": 1, "fsdp": 2, "sp": 4}, argument_bytes=2 ** 30,
                            output_bytes=2 ** 30, alias_bytes=2 ** 30, temp_bytes=200 * 2 ** 30,
                            compile_seconds=1.0)
    batch = [r for r in aot.suggest_remedies(_config(accum), over) if "global_batch_size" in r]
    if advice is None:
        assert batch == []
    else:
        assert len(batch) == 1 and batch[0].startswith(f"--config.data.global_batch_size=4 {advice}")
