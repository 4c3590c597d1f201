"""The optimizer's rules about parameters: weight decay is chosen per parameter, not by rank."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from longctx.model.decoder import weight_decay_mask
from longctx.parallel import mesh as mesh_lib
from longctx.train import optimizer as train_optimizer
from longctx.train import state as train_state

NOT_DECAYED = {"attn_norm", "mlp_norm", "final_norm", "sinks"}


def _config(scan_layers: bool):
    c = base.get_config("tiny")
    c.unlock()
    c.mesh.update(dp=1, fsdp=1, sp=1)
    c.model.update(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                   mlp_dim=48, dtype="float32", tie_embeddings=False, scan_layers=scan_layers)
    c.attention.update(attention_sinks=True)
    # A non-zero rate at step 0 (no warmup) and no clipping: the only update is the decay.
    c.optimizer.update(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1, grad_clip_norm=None)
    return c


def _names(path) -> str:
    """"blocks/attn_norm" for a path into an nnx.State (the Variable's own ".value" dropped)."""
    return "/".join(str(getattr(k, "key", k)) for k in path if str(k) != ".value")


@pytest.mark.parametrize("scan_layers", [True, False])
def test_zero_gradients_decay_every_matrix_and_no_norm_or_sink(scan_layers):
    config = _config(scan_layers)
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        state = setup.init(jax.random.PRNGKey(0))
        # Every value non-zero (sinks start at 0, where a decay would be invisible).
        params = jax.tree.map(lambda p: jnp.full_like(p, 0.5), state.params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, _ = setup.optimizer.update(zeros, state.opt_state, params)
    seen = set()
    for path, update in jax.tree_util.tree_flatten_with_path(jax.device_get(updates))[0]:
        name = _names(path)
        leaf = name.split("/")[-1]
        seen.add(leaf)
        if leaf in NOT_DECAYED:
            assert np.all(update == 0), f"{name} (norm scale or sink) was decayed"
        else:
            assert np.all(update != 0), f"{name} (a matrix) was not decayed everywhere"
    # The stacked layers make every per-layer vector 2-D: the rule must not depend on rank.
    assert NOT_DECAYED <= seen and {"wq", "w_down", "embed", "unembed"} <= seen


def test_mask_reads_the_declaration_not_the_rank():
    config = _config(scan_layers=True)
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        abstract = train_state.make_setup(config, mesh, "contiguous").abstract_state.params
    mask = {_names(p).split("/")[-1]: m for p, m in jax.tree_util.tree_flatten_with_path(weight_decay_mask(abstract))[0]}
    shapes = {_names(p).split("/")[-1]: a.shape for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    assert len(shapes["attn_norm"]) == 2 and len(shapes["sinks"]) == 2  # [layers, d], [layers, heads]
    assert {name for name, decayed in mask.items() if not decayed} == NOT_DECAYED
    assert sum(mask.values()) == 9  # embed, unembed, wq, wk, wv, wo, w_gate, w_up, w_down


# ----------------------------------------------------------------------------- learning-rate schedule


def _schedule_config(num_steps=1000, warmup_steps=100):
    c = base.get_config("tiny")
    c.unlock()
    c.optimizer.update(learning_rate=3e-3, min_learning_rate_ratio=0.1, warmup_steps=warmup_steps)
    c.train.num_steps = num_steps
    return c


def test_learning_rate_warms_up_linearly_then_decays_by_a_cosine_to_the_floor():
    """The shape the config promises, at the update counts `applied_updates` feeds it: 0 -> peak
    linearly over warmup_steps, then half a cosine down to learning_rate * min_learning_rate_ratio
    at num_steps. (float32 arithmetic in optax: rtol 1e-6 is a few of its ulps.)"""
    config = _schedule_config(num_steps=1000, warmup_steps=100)
    peak, floor = 3e-3, 3e-4
    schedule = train_optimizer.learning_rate_schedule(config)
    rate = lambda n: float(schedule(n))  # noqa: E731
    assert rate(0) == 0.0
    for n in (1, 25, 50, 99):
        np.testing.assert_allclose(rate(n), peak * n / 100, rtol=1e-6)
    np.testing.assert_allclose(rate(100), peak, rtol=1e-6)
    # After the warmup, a cosine over the remaining 900 updates: half-way, the mean of peak and
    # floor; a quarter of the way, floor + (peak - floor) * (1 + cos(pi/4)) / 2. A linear decay
    # (or none) misses both.
    np.testing.assert_allclose(rate(550), (peak + floor) / 2, rtol=1e-6)
    np.testing.assert_allclose(rate(325), floor + (peak - floor) * (1 + np.cos(np.pi / 4)) / 2, rtol=1e-6)
    np.testing.assert_allclose(rate(1000), floor, rtol=1e-6)
    np.testing.assert_allclose(rate(5000), floor, rtol=1e-6)  # (past the end: stays at the floor)
    decay = np.array([rate(n) for n in range(100, 1001)])
    assert np.all(np.diff(decay) < 0), "the rate must fall at every update after the warmup"


def test_a_warmup_longer_than_the_run_is_cut_and_said():
    config = _schedule_config(num_steps=50, warmup_steps=100)
    schedule = train_optimizer.learning_rate_schedule(config)
    rates = np.array([float(schedule(n)) for n in range(50)])
    np.testing.assert_allclose(rates, 3e-3 * np.arange(50) / 50, rtol=1e-6)  # cut to the run
    notes = train_optimizer.optimizer_notes(config)
    assert notes == ["optimizer.warmup_steps=100 is more than train.num_steps=50: the warmup is cut to "
                     "50 steps, so the learning rate rises until the last step, never reaching "
                     "optimizer.learning_rate=0.003, and never decays."]
    assert train_optimizer.optimizer_notes(_schedule_config(num_steps=100, warmup_steps=100)) == []


def test_a_resume_with_more_steps_says_the_schedule_is_re_stretched():
    saved = _schedule_config(num_steps=200, warmup_steps=10)
    config = _schedule_config(num_steps=400, warmup_steps=10)
    before = float(train_optimizer.learning_rate_schedule(saved)(200))
    after = float(train_optimizer.learning_rate_schedule(config)(200))
    assert before < after  # the old run had decayed to its floor; the new one is half-way down
    assert train_optimizer.optimizer_notes(config, saved.to_dict(), updates=200) == [
        "the learning-rate schedule differs from the checkpoint's (train.num_steps: checkpoint 200 vs "
        "config 400): its cosine decay is re-stretched to end at step 400, and the rate of update 201 "
        f"is {after:.3g}, where the checkpoint's schedule had {before:.3g}."]
    assert train_optimizer.optimizer_notes(config, config.to_dict(), updates=200) == []  # the same schedule


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_float16_is_refused_naming_the_key_and_the_fix(key):
    from longctx import config as config_lib

    config = _config(scan_layers=True)
    config.model[key] = "float16"
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.validate(config, num_devices=1)
    assert str(error.value) == (
        f"model.{key}='float16' trains without loss scaling, which longctx does not do, so small gradients "
        f"underflow to zero: set model.{key}=bfloat16 (float32's range) or float32.")


def test_bfloat16_parameters_make_bfloat16_moments_and_the_start_up_says_so():
    config = _config(scan_layers=True)
    config.model.param_dtype = "bfloat16"
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        abstract = train_state.make_setup(config, mesh, "contiguous").abstract_state
    moments = [leaf for leaf in jax.tree.leaves(abstract.opt_state) if leaf.ndim > 0]
    assert moments and {leaf.dtype for leaf in moments} == {jnp.dtype(jnp.bfloat16)}  # what the note says
    assert train_optimizer.optimizer_notes(config) == [
        "model.param_dtype=bfloat16: AdamW's moments are kept in bfloat16 too (optax follows the "
        "parameters' dtype), so updates much smaller than a weight round away; "
        "model.param_dtype=float32 keeps parameters and moments in full precision."]
    config.model.param_dtype = "float32"
    assert train_optimizer.optimizer_notes(config) == []


@pytest.mark.parametrize("value", [0, -3])
def test_max_consecutive_skips_must_be_positive(value):
    from longctx import config as config_lib

    config = _config(scan_layers=True)
    config.train.max_consecutive_skips = value
    with pytest.raises(config_lib.ConfigError, match=rf"^train.max_consecutive_skips={value} must be a "
                                                     r"positive number of steps.$"):
        config_lib.validate(config, num_devices=1)
