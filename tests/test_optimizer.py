"""The optimizer's rules about parameters: weight decay is chosen per parameter, not by rank."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from longctx import mesh as mesh_lib
from longctx import train
from longctx.model import weight_decay_mask

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
        setup = train.make_setup(config, mesh, "contiguous")
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
        abstract = train.make_setup(config, mesh, "contiguous").abstract_state.params
    mask = {_names(p).split("/")[-1]: m for p, m in jax.tree_util.tree_flatten_with_path(weight_decay_mask(abstract))[0]}
    shapes = {_names(p).split("/")[-1]: a.shape for p, a in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    assert len(shapes["attn_norm"]) == 2 and len(shapes["sinks"]) == 2  # [layers, d], [layers, heads]
    assert {name for name, decayed in mask.items() if not decayed} == NOT_DECAYED
    assert sum(mask.values()) == 9  # embed, unembed, wq, wk, wv, wo, w_gate, w_up, w_down
