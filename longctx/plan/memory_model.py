"""A fast model of a train step's HBM per device, to prune a plan's candidates before any compile.

    per_device_bytes(config, mesh_sizes) -> MemoryEstimate

Counted, as plan/memory.py measures them on a compiled step: parameters and AdamW state (split
over fsdp x sp, the state over dp too with ZeRO-1), gradients (sharded as the parameters), what
each layer keeps for its backward (the remat and residual policies), and the largest working set
of one layer's backward (the strategy's K/V or heads, the MLP chunk, the loss chunk's logits),
for one micro-batch where train.grad_accum_steps splits the batch.
The compiler's own figure holds more than the arrays named here (copies, padding to tiles,
buffers it keeps alive across a fusion), so the activation terms are scaled by ACTIVATION_SCALE,
fitted on whole-step TPU compiles (benchmarks/calibrate_planner.py: the points and their error are
in docs/planner.md). The planner compiles its best rows for their true figure; this only prunes.
"""

from __future__ import annotations

import dataclasses

from longctx import config as config_lib
from longctx.model import attention as attention_lib
from longctx.model import remat
from longctx.plan import collectives
from longctx.train import steps as train_steps

# Fitted on the AOT compiles of docs/fit_*.json and docs/fit_strategies.json
# (benchmarks/calibrate_planner.py).
ACTIVATION_SCALE = 1.19


@dataclasses.dataclass
class MemoryEstimate:
    state_bytes: int          # parameters + optimizer state
    gradient_bytes: int
    saved_bytes: int          # every layer's residuals for the backward
    working_bytes: int        # one layer's backward at its largest
    scale: float = ACTIVATION_SCALE

    @property
    def total_bytes(self) -> int:
        """The compiler's figure: the state and the step's temporaries."""
        return int(self.state_bytes + self.gradient_bytes
                   + self.scale * (self.saved_bytes + self.working_bytes))

    def held_bytes(self, program_share: float | None = None) -> int:
        """What a chip must have for the step: the compiler's figure, or on a chip whose runtime
        was measured to hold `program_share` of the temporaries (plan/measured_memory.py), the
        larger of that hold and the temporaries alone (the compiler's own test)."""
        if program_share is None:
            return self.total_bytes
        temporaries = self.total_bytes - self.state_bytes
        return max(int(self.state_bytes + program_share * temporaries), temporaries)


def _saved_per_token(config, sp: int) -> float:
    """Bytes one layer keeps per token for its backward on a mesh of `sp` sequence shards."""
    m, a = config.model, config.attention
    e = 2 if m.dtype == "bfloat16" else 4
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim * e
    attention_out = m.num_heads * m.head_dim * e + m.num_heads * 4  # out and its log-sum-exp
    carry = m.d_model * e  # the layer's input, which the scan over layers keeps
    residuals = a.get("residuals", "save_qkv")
    kept_qkv = qkv if residuals == "save_qkv" else 0
    if m.remat_policy == "nothing_saveable":
        return carry + kept_qkv + attention_out
    if m.remat_policy in remat.NAMED_POLICIES:  # what it names that the backward reads
        return carry + kept_qkv + attention_out + sum(remat.output_width(m, name)
                                                      for name in remat.kept_names(config, sp)) * e
    if m.remat_policy in remat.DOTS_POLICIES:
        return carry + qkv + attention_out + (2 * m.d_model + 2 * m.mlp_dim) * e
    if m.remat_policy != "none":
        raise ValueError(f"the memory model has no figure for model.remat_policy={m.remat_policy!r}.")
    # no remat: every intermediate of the layer
    return carry + qkv + attention_out + (4 * m.d_model + 4 * m.mlp_dim) * e


def _attention_working(config, attention, sp: int, rows: int) -> float:
    """The strategy's largest attention arrays on one device, one layer (forward + backward), for
    a layer type's resolved `attention` config: its own account (ops/strategy.py
    `working_bytes`)."""
    shape = collectives.type_shape(config, attention, sp, rows)
    cfg = collectives.type_config(attention, shape, config.attention.layout)
    return attention_lib.strategy_of(attention).working_bytes(shape, cfg)


def per_device_bytes(config, mesh_sizes: dict[str, int]) -> MemoryEstimate:
    m, d, t = config.model, config.data, config.train
    dp, fsdp, sp = mesh_sizes["dp"], mesh_sizes["fsdp"], mesh_sizes["sp"]
    params = config_lib.num_params_estimate(config)
    p_bytes = 2 if m.param_dtype == "bfloat16" else 4
    param_ways = fsdp * sp
    state_ways = param_ways * (dp if config.optimizer.get("shard_state_over_dp", False) else 1)
    state = params * p_bytes / param_ways + params * 2 * p_bytes / state_ways
    gradients = params * p_bytes / param_ways
    # With gradient accumulation, activations are one micro-batch's, and beside each micro-batch's
    # own gradients the compiler keeps two float32 copies of the parameters' size: the running sum,
    # live through the whole forward, and the sum it is adding to (the v5e_0p5b step compiled
    # for v5e: +4.07 GiB of temporaries with 4 micro-batches of 16,384 tokens, +4.6 GiB at 32,768,
    # for 1.91 GiB of float32 parameters).
    accum = train_steps.grad_accum_steps(config)
    if accum > 1:
        gradients += 2 * params * 4 / param_ways
    rows = d.global_batch_size // (dp * fsdp * accum)
    tokens = rows * d.seq_len // sp
    e = 2 if m.dtype == "bfloat16" else 4
    saved = m.num_layers * tokens * _saved_per_token(config, sp)
    chunk = min(m.get("mlp_chunk_size") or d.seq_len // sp, d.seq_len // sp)
    mlp = rows * chunk * m.mlp_dim * e * 3 * 2  # gate, up, activation; and their gradients
    logits = rows * min(t.loss_chunk_size, d.seq_len // sp) * m.vocab_size * 4 * 2
    layer = tokens * (m.d_model * e * 6 + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim * e * 2)
    gathered = config_lib.num_params_estimate(config) / m.num_layers * e * 2  # this layer and the next
    working = max(mlp, logits) + layer + max(
        _attention_working(config, t.attention, sp, rows)
        for t, _ in collectives.type_layers(config)) + gathered
    return MemoryEstimate(int(state), int(gradients), int(saved), int(working))
