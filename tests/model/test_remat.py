"""The named remat policies (model/remat.py, MaxText's): each gives nothing_saveable's loss and
gradients, keeps per layer exactly the named outputs its block's backward reads, and the memory
model and the FLOPs count price what it keeps."""

from __future__ import annotations

import functools
import os

import jax
import pytest

from longctx.model import flops, remat
from longctx.parallel import mesh as mesh_lib
from longctx.plan import memory, memory_model
from longctx.train import state as train_state
from tests.model.test_attention_residuals import ROWS, _assert_same, _config, _loss_and_grads

# A block whose backward reads every name: QK-norm reads q and k before it, the sandwich's norm of
# the MLP's output reads the down projection's.
EVERY_NAME_READ = dict(qk_norm="per_head", norm_position="sandwich")


def _block(policy: str, **model):
    c = _config("save_qkv")
    c.model.update(remat_policy=policy, **model)
    return c


@functools.lru_cache(maxsize=None)
def _gradients(policy: str):
    return _loss_and_grads(_block(policy, **EVERY_NAME_READ), ROWS)


# One that keeps every name and one that keeps a part (every policy with LONGCTX_EXHAUSTIVE=1).
GRADIENT_POLICIES = (list(remat.NAMED_POLICIES) if os.environ.get("LONGCTX_EXHAUSTIVE")
                     else ["minimal", "save_dot_except_mlp"])


@pytest.mark.parametrize("policy", GRADIENT_POLICIES)
def test_named_policies_give_nothing_saveable_s_gradients(policy):
    _assert_same(_gradients(policy), _gradients("nothing_saveable"))


@functools.lru_cache(maxsize=None)
def _saved_per_layer(policy: str, model: tuple) -> dict[str, int]:
    """{what: bytes} of one layer's residuals per device, the named outputs by name."""
    config = _block(policy, **dict(model))
    mesh = mesh_lib.make_mesh(config.mesh)
    layout = train_state.resolve_layout(config, mesh.shape[mesh_lib.SP])
    setup = train_state.make_setup(config, mesh, layout)
    out: dict[str, int] = {}
    for r in memory.layer_residuals(config, mesh, layout, setup):
        if r["per_layer"]:
            named = [n for n in remat.SAVEABLE_NAMES if f"name '{n}'" in r["source"]]
            key = named[0] if named else r["source"]
            out[key] = out.get(key, 0) + r["bytes"]
    return out


# Every named policy where the block reads every name; on Llama's block, the one that names all.
KEEPING_CASES = ([(p, "qk_norm_sandwich") for p in remat.NAMED_POLICIES] + [("minimal", "llama")])
MODELS = {"llama": {}, "qk_norm_sandwich": EVERY_NAME_READ}


@pytest.mark.parametrize("policy,model", KEEPING_CASES)
def test_a_named_policy_keeps_the_names_its_backward_reads(policy, model):
    """Per layer, beyond nothing_saveable's residuals, exactly the outputs `kept_names` says, each
    [batch, tokens per device, width] (value_proj is the ring's own v under any policy: the ring
    keeps its input). Llama's block reads neither q and k before RoPE nor the MLP's output."""
    model = MODELS[model]
    config = _block(policy, **model)
    base = _saved_per_layer("nothing_saveable", tuple(sorted(model.items())))
    kept = _saved_per_layer(policy, tuple(sorted(model.items())))
    sp = config.mesh.sp
    tokens = config.data.global_batch_size // (config.mesh.dp * config.mesh.fsdp) * config.data.seq_len // sp
    extra = {k: v - base.get(k, 0) for k, v in kept.items() if v != base.get(k, 0)}
    names = remat.kept_names(config, sp)
    assert extra == {n: tokens * remat.output_width(config.model, n) * 4 for n in names}, (extra, names)
    if model:
        assert names == tuple(n for n in remat.NAMED_POLICIES[policy] if n != "value_proj")
    else:
        assert names == ("out_proj", "mlp_gate", "mlp_up")
    # the memory model prices the same bytes per token
    sizes = {"dp": config.mesh.dp, "fsdp": config.mesh.fsdp, "sp": sp}
    nothing = _block("nothing_saveable", **model)
    assert (memory_model.per_device_bytes(config, sizes).saved_bytes
            - memory_model.per_device_bytes(nothing, sizes).saved_bytes
            == config.model.num_layers * sum(extra.values()))


def test_the_flops_count_recomputes_the_matmuls_a_policy_does_not_keep():
    """Per layer and token: q/k/v 128 x (4 + 2 + 2) x 32, out 128 x 128, MLP 3 x 128 x 384 weights;
    recomputed work counts 2 FLOPs per weight of the matmuls whose outputs are not kept."""
    c = _block("nothing_saveable")
    tokens = c.data.global_batch_size * c.data.seq_len
    qkv, out, mlp = 128 * 8 * 32, 128 * 128, 128 * 384
    per_token = {"nothing_saveable": qkv + out + 3 * mlp, "none": 0, "dots_saveable": 0,
                 "save_qkv_proj": out + 3 * mlp, "save_out_proj": qkv + 3 * mlp,
                 "save_dot_except_mlp": 3 * mlp, "save_dot_except_mlpwi": 2 * mlp, "minimal": 0}
    for policy, weights in per_token.items():
        c.model.remat_policy = policy
        assert flops.recomputed_flops_per_step(c) == 2 * c.model.num_layers * tokens * weights, policy
