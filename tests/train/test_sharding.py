"""Where the train state lives: parameters, gradients and optimizer state sharded over fsdp x sp
(and the optimizer state over dp too, optionally), the same step as the old fsdp-only layout, and
checkpoints written under the old layout restoring onto the new one."""

from __future__ import annotations

import sys

import jax
import numpy as np

from longctx import data as data_lib
from longctx.parallel import mesh as mesh_lib
from longctx.train import checkpoint as checkpoint_lib
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from tests import ROOT

sys.path.insert(0, ROOT)
from configs import base as base_config  # noqa: E402

# The rules before parameters were split over sp: fsdp only, norm scales replicated.
OLD_RULES = {"embed": mesh_lib.FSDP, "norm": None}


def _config(dp=1, fsdp=2, sp=4, over_dp=False):
    c = base_config.get_config("tiny")
    c.mesh.dp, c.mesh.fsdp, c.mesh.sp = dp, fsdp, sp
    c.model.num_layers = 1
    c.attention.attention_sinks = False
    c.data.seq_len, c.data.global_batch_size = 512, 2 * dp * fsdp
    c.attention.block_size, c.train.loss_chunk_size = 64, 64
    c.optimizer.shard_state_over_dp = over_dp
    c.optimizer.warmup_steps = 0  # a non-zero learning rate at the first step
    return c


def _setup(config):
    mesh = mesh_lib.make_mesh(config.mesh)
    layout = train_state.resolve_layout(config, mesh.shape[mesh_lib.SP])
    return mesh, layout, train_state.make_setup(config, mesh, layout)


def _mesh_axes(sharding) -> set[str]:
    return set(mesh_lib.spec_axes(sharding.spec))


def _named_leaves(tree):
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def test_every_parameter_and_optimizer_leaf_is_split_over_fsdp_and_sp():
    config = _config(dp=1, fsdp=2, sp=4)
    _, _, setup = _setup(config)
    shardings, abstract = setup.state_shardings, setup.abstract_state
    params = _named_leaves(shardings.params)
    assert params, "no parameters"
    for name, sharding in params:
        assert {"fsdp", "sp"} <= _mesh_axes(sharding), f"params{name}: {sharding.spec}"
    # Every optimizer array of a parameter's shape (AdamW's mu and nu); scalars (the step count)
    # are the only replicated leaves.
    opt = list(zip(_named_leaves(shardings.opt_state), jax.tree.leaves(abstract.opt_state)))
    arrays = [(name, s, leaf) for (name, s), leaf in opt if leaf.ndim > 0]
    assert len(arrays) == 2 * len(params)
    for name, sharding, leaf in arrays:
        assert {"fsdp", "sp"} <= _mesh_axes(sharding), f"opt_state{name}: {sharding.spec}"
        # each device holds 1/8 of the array
        assert np.prod(sharding.shard_shape(leaf.shape)) * 8 == np.prod(leaf.shape), name
    assert all(leaf.ndim == 0 for (_, s), leaf in opt if _mesh_axes(s) == set())


def test_optimizer_state_over_dp_leaves_parameters_whole_over_dp():
    config = _config(dp=2, fsdp=1, sp=4, over_dp=True)
    _, _, setup = _setup(config)
    for name, sharding in _named_leaves(setup.state_shardings.params):
        assert _mesh_axes(sharding) == {"fsdp", "sp"}, f"params{name}: {sharding.spec}"
    opt = zip(_named_leaves(setup.state_shardings.opt_state), jax.tree.leaves(setup.abstract_state.opt_state))
    for (name, sharding), leaf in opt:
        if leaf.ndim:
            assert _mesh_axes(sharding) == {"dp", "fsdp", "sp"}, f"opt_state{name}: {sharding.spec}"


def test_optimizer_rules_add_dp_only_to_parameter_axes():
    rules = mesh_lib.optimizer_rules(over_dp=True)
    assert rules["embed"] == ("dp", "fsdp", "sp") and rules["norm"] == ("dp", "fsdp", "sp")
    assert rules["activation_length"] == "sp" and rules["vocab"] is None
    assert mesh_lib.optimizer_rules(over_dp=False) is mesh_lib.LOGICAL_RULES
    assert mesh_lib.gathered_spec(("embed", "heads", "head_dim")) == jax.sharding.PartitionSpec(None, None, None)


def _two_steps(config, state, setup):
    train_step, _ = train_steps.jit_steps(config, setup)
    batches = [_batch(config, setup, seed) for seed in (1, 2)]
    losses = []
    with jax.set_mesh(setup.batch_sharding.mesh):
        for batch in batches:
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, state.params)


def _batch(config, setup, seed):
    """A packed-looking batch: random tokens, three documents per row."""
    rng = np.random.default_rng(seed)
    b, s = config.data.global_batch_size, config.data.seq_len
    cuts = np.sort(rng.choice(np.arange(1, s), size=2, replace=False))
    segment = 1 + (np.arange(s)[None, :] >= cuts[:, None]).sum(0)
    starts = np.concatenate([[0], cuts])
    positions = np.arange(s) - starts[segment - 1]
    host = {"tokens": rng.integers(0, config.model.vocab_size, (b, s)),
            "targets": rng.integers(0, config.model.vocab_size, (b, s)),
            "positions": np.broadcast_to(positions, (b, s)),
            "segment_ids": np.broadcast_to(segment, (b, s)),
            "loss_mask": np.ones((b, s))}
    return {k: jax.device_put(np.ascontiguousarray(host[k]).astype(np.int32), setup.batch_sharding)
            for k in train_steps.BATCH_KEYS}


def test_train_step_is_the_same_under_the_old_and_new_sharding(monkeypatch):
    """Two AdamW steps on a 1x2x4 mesh: fsdp-only parameters (the old rules) against fsdp x sp.
    The same arithmetic, only the collectives differ: loss and every parameter agree to float32
    rounding (<= 1e-6 relative, in norm: AdamW divides each gradient element by its own size, so
    an element whose gradient is ~0 moves by an amount set by rounding; measured ~1e-8)."""
    config = _config(dp=1, fsdp=2, sp=4)
    with monkeypatch.context() as patch:
        for name, axes in OLD_RULES.items():
            patch.setitem(mesh_lib.LOGICAL_RULES, name, axes)
        _, _, old_setup = _setup(config)
        state = old_setup.init(jax.random.PRNGKey(0))
        old_losses, old_params = _two_steps(config, state, old_setup)
        assert "sp" not in _mesh_axes(jax.tree.leaves(old_setup.state_shardings.params)[0])
    _, _, new_setup = _setup(config)
    state = jax.device_put(old_setup.init(jax.random.PRNGKey(0)), new_setup.state_shardings)
    new_losses, new_params = _two_steps(config, state, new_setup)
    np.testing.assert_allclose(new_losses, old_losses, rtol=1e-6)
    moved = 0
    for (name, new), old, start in zip(_named_leaves(new_params), jax.tree.leaves(old_params),
                                       jax.tree.leaves(jax.tree.map(np.asarray, old_setup.init(jax.random.PRNGKey(0)).params))):
        err = np.linalg.norm(new - old) / np.linalg.norm(old)
        assert err <= 1e-6, f"params{name}: relative difference {err:.2e}"
        moved += not np.array_equal(old, start)
    assert moved == len(jax.tree.leaves(old_params)), "a parameter did not move: the comparison proves nothing"


def test_checkpoint_saved_under_the_old_sharding_restores_onto_the_new(tmp_path, monkeypatch):
    """A checkpoint written when parameters were split over fsdp only (and norms replicated)
    restores bitwise onto fsdp x sp: Orbax stores global arrays and reshards them on load."""
    config = _config(dp=1, fsdp=2, sp=4)
    workdir = str(tmp_path / "run")
    data_dir = data_lib.resolve_dataset(config)

    def iterator_for(mesh, layout):
        return lambda seed_offset=0: data_lib.make_batch_iterator(
            config, mesh, split="train", layout=layout, data_dir=data_dir, seed_offset=seed_offset)

    with monkeypatch.context() as patch:
        for name, axes in OLD_RULES.items():
            patch.setitem(mesh_lib.LOGICAL_RULES, name, axes)
        mesh, layout, old_setup = _setup(config)
        saved = old_setup.init(jax.random.PRNGKey(3))
        iterator = iterator_for(mesh, layout)()
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        assert checkpointer.maybe_save(1, saved, iterator, force=True)
        checkpointer.close()
        iterator.close()
    mesh, layout, new_setup = _setup(config)
    checkpointer = checkpoint_lib.Checkpointer(workdir, config)
    with jax.set_mesh(mesh):
        restored, iterator, note = checkpointer.restore_or_init(new_setup, iterator_for(mesh, layout))
    checkpointer.close()
    iterator.close()
    assert "step 1" in note, note
    for (name, got), want, sharding in zip(_named_leaves(restored), jax.tree.leaves(saved),
                                            jax.tree.leaves(new_setup.state_shardings)):
        assert got.sharding.is_equivalent_to(sharding, got.ndim), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
