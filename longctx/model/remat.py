"""The rematerialisation policies of a decoder block (`model.remat_policy`): what each keeps for
the backward and what it runs again.

  none                 no checkpoint: every intermediate of the block is kept
  nothing_saveable     everything but the attention's own residuals is recomputed
  dots_saveable, dots_with_no_batch_dims_saveable   every matmul's output is kept (JAX's policies)
  save_qkv_proj, save_out_proj, save_dot_except_mlp, save_dot_except_mlpwi, minimal
                       MaxText's named policies: the matmul outputs named in NAMED_POLICIES are
                       kept (`jax.checkpoint_policies.save_only_these_names`), the rest recomputed

The block names its matmuls' outputs with `checkpoint_name` (model/decoder.py), as MaxText does;
its query_proj, key_proj, value_proj and out_proj are MaxText's, and its mlpwi_0, mlpwi_1 and
mlpwo are mlp_gate, mlp_up and mlp_down here. A name a policy keeps costs memory only where the
block's backward reads that value (`kept_names`): under attention.residuals=save_qkv the ring keeps
q, k and v after RoPE itself, so the projections' own outputs are read only through a QK-norm; the
MLP's down projection only through a norm of the MLP's output; and model.mlp_chunk_size runs each
MLP chunk under a checkpoint of its own, which recomputes it whatever the block's policy. Every
place that prices a policy asks this module: the memory model (plan/memory_model.py, through
`kept_names` and `output_width`) and the FLOPs recomputed (model/flops.py, `kept_matmuls`).
"""

from __future__ import annotations

import jax

from longctx.model import block_options

# The matmul outputs of a block that a policy can keep by name, in the order the block makes them.
SAVEABLE_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down")
_QKV = ("query_proj", "key_proj", "value_proj")

# MaxText's named policies and what each keeps of one block.
NAMED_POLICIES = {
    "save_qkv_proj": _QKV,
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": (*_QKV, "out_proj"),
    "save_dot_except_mlpwi": (*_QKV, "out_proj", "mlp_down"),
    "minimal": SAVEABLE_NAMES,
}

POLICIES = {
    "none": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **{name: jax.checkpoint_policies.save_only_these_names(*kept) for name, kept in NAMED_POLICIES.items()},
}

# The policies that keep every matmul's output.
DOTS_POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable")


def matmul_weights(model_config) -> dict[str, int]:
    """The weights of each named matmul of one block (its FLOPs: 2 per weight per token)."""
    m = model_config
    return {"query_proj": m.d_model * m.num_heads * m.head_dim, "key_proj": m.d_model * m.num_kv_heads * m.head_dim,
            "value_proj": m.d_model * m.num_kv_heads * m.head_dim, "out_proj": m.num_heads * m.head_dim * m.d_model,
            "mlp_gate": m.d_model * m.mlp_dim, "mlp_up": m.d_model * m.mlp_dim, "mlp_down": m.mlp_dim * m.d_model}


def output_width(model_config, name: str) -> int:
    """Values per token of a named matmul's output."""
    m = model_config
    return {"query_proj": m.num_heads * m.head_dim, "key_proj": m.num_kv_heads * m.head_dim,
            "value_proj": m.num_kv_heads * m.head_dim, "out_proj": m.d_model,
            "mlp_gate": m.mlp_dim, "mlp_up": m.mlp_dim, "mlp_down": m.d_model}[name]


def kept_matmuls(model_config) -> tuple[str, ...]:
    """The named matmuls whose outputs the policy keeps (all of them under none and the dots
    policies, none under nothing_saveable), whether or not the backward reads them."""
    policy = model_config.remat_policy
    if policy == "none" or policy in DOTS_POLICIES:
        return SAVEABLE_NAMES
    return NAMED_POLICIES.get(policy, ())


def kept_names(config, sp: int) -> tuple[str, ...]:
    """The named outputs a named policy makes the block keep per layer on a mesh of `sp` sequence
    shards: those it names that the block's backward reads (see the module docstring). () for the
    other policies."""
    m = config.model
    if m.remat_policy not in NAMED_POLICIES:
        return ()
    o = block_options.options(m)
    read = {"out_proj"}
    if o.qk_norm != "none":
        read |= {"query_proj", "key_proj"}
    chunked = bool(m.get("mlp_chunk_size")) and config.data.seq_len // sp > m.mlp_chunk_size
    if not chunked:
        read |= {"mlp_gate", "mlp_up"} | ({"mlp_down"} if o.post_norms else set())
    return tuple(name for name in NAMED_POLICIES[m.remat_policy] if name in read)
