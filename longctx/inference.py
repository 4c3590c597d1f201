"""Forward passes outside the training loop, on the sharded model exactly as in training.

Rows come in natural order (`tokens`, and optionally `positions` and `segment_ids`, int [b, n]);
they are padded to a sequence length the ring accepts, permuted into the run's sp layout (as the
data pipeline does), placed batch over (dp, fsdp) and sequence over sp, and run through
`longctx.model.Decoder` under the run's mesh. Logits are computed only at the positions asked
for (all of them for a logit check, a passkey's few tokens for a retrieval test), so the
[b, S, vocab] array of a long sequence is never formed unless requested.

Legend: b batch, t token (layout order), p requested position, d model width, v vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from longctx import config as config_lib
from longctx import layout as layout_lib
from longctx import mesh as mesh_lib
from longctx import params_io
from longctx import train


@dataclasses.dataclass(frozen=True)
class Runner:
    """A model ready to run: its config, mesh, layout, parameters and the jitted forward."""

    config: Any
    mesh: Any
    layout: str
    setup: train.Setup
    params: Any
    forward_at: Any  # jitted (params, batch, index) -> logits

    @property
    def sp(self) -> int:
        return int(self.mesh.shape[mesh_lib.SP])

    def logits_at(self, rows: dict, where: np.ndarray) -> np.ndarray:
        """float32 logits [b, p, v] at natural positions `where` [b, p] of natural-order `rows`."""
        batch, perm = self._laid_out(rows)
        inverse = layout_lib.inverse_permutation(perm)
        index = inverse[np.asarray(where)].astype(np.int32)  # natural position -> layout index
        index = jax.device_put(index, NamedSharding(self.mesh, PartitionSpec()))
        with jax.set_mesh(self.mesh):
            out = self.forward_at(self.params, batch, index)
        return np.asarray(jax.device_get(out))

    def _laid_out(self, rows: dict) -> tuple[dict, np.ndarray]:
        seq_len = self.config.data.seq_len
        tokens = np.asarray(rows["tokens"], np.int32)
        b, n = tokens.shape
        if n > seq_len:
            raise ValueError(f"rows of {n} tokens are longer than data.seq_len={seq_len}.")
        full = {"tokens": np.zeros((b, seq_len), np.int32),
                "positions": np.zeros((b, seq_len), np.int32),
                "segment_ids": np.zeros((b, seq_len), np.int32)}  # segment 0: padding, attends to nothing real
        full["tokens"][:, :n] = tokens
        full["positions"][:, :n] = rows.get("positions", np.broadcast_to(np.arange(n), (b, n)))
        full["segment_ids"][:, :n] = rows.get("segment_ids", np.ones((b, n), np.int32))
        perm = layout_lib.permutation(self.layout, seq_len, self.sp)
        sharding = mesh_lib.batch_sharding(self.mesh)
        return {k: jax.device_put(v[:, perm], sharding) for k, v in full.items()}, perm


def _forward_at(graphdef, params, batch, index):
    model = nnx.merge(graphdef, params)
    m = model.config.model
    hidden = model(batch["tokens"], batch["positions"], batch["segment_ids"])
    picked = jnp.take_along_axis(hidden, index[..., None], axis=1)  # [b, p, d]
    logits = jnp.einsum("bpd,dv->bpv", picked, model.unembedding().astype(picked.dtype),
                        preferred_element_type=jnp.float32)
    if m.final_logits_soft_cap is not None:
        logits = m.final_logits_soft_cap * jnp.tanh(logits / m.final_logits_soft_cap)
    return logits


def ring_seq_len(n: int, sp: int, block_size: int, layout: str) -> int:
    """The shortest sequence length >= n that `sp` shards of whole `block_size` blocks can hold
    (zigzag also halves each shard)."""
    unit = sp * block_size * (2 if layout == "zigzag" else 1)
    return max(unit, math.ceil(n / unit) * unit)


def fit_to_ring(config, sp: int) -> dict:
    """Overrides that shrink attention.block_size and train.loss_chunk_size (halving) until they
    divide this sequence length's shards, for running a checkpoint at another length or mesh."""
    shard = config.data.seq_len // sp
    unit = shard // 2 if config.attention.layout in ("zigzag", "auto") else shard
    block, chunk = config.attention.block_size, config.train.loss_chunk_size
    while block > 1 and unit % block:
        block //= 2
    while chunk > 1 and shard % chunk:
        chunk //= 2
    return {"attention.block_size": block, "train.loss_chunk_size": chunk}


def make_runner(config, params_from, mesh=None, *, setup: train.Setup | None = None,
                layout: str | None = None) -> Runner:
    """A Runner for `config` (validated against the devices), with parameters from
    `params_from(abstract_params, shardings)`. The training loop passes its own mesh, setup and
    layout (and its parameters later, with `dataclasses.replace`)."""
    config_lib.validate(config)
    mesh = mesh_lib.make_mesh(config.mesh) if mesh is None else mesh
    layout = layout or train.resolve_layout(config, int(mesh.shape[mesh_lib.SP]))
    with jax.set_mesh(mesh):
        setup = setup or train.make_setup(config, mesh, layout)
        params = params_from(setup.abstract_state.params, setup.state_shardings.params)
    # Replicated out: every process can read the (small) logits it asked for.
    forward_at = jax.jit(functools.partial(_forward_at, setup.graphdef),  # (closes over the model's structure)
                         out_shardings=NamedSharding(mesh, PartitionSpec()))
    return Runner(config, mesh, layout, setup, params, forward_at)


def runner_from_checkpoint(path: str, overrides: dict | None = None) -> Runner:
    """A Runner for the newest checkpoint under `path`, with its saved config changed by
    `overrides` (dotted keys: mesh, attention.impl, data.seq_len, ...)."""
    from longctx import hf  # (apply_overrides: the same dotted-key setter the converter uses)

    config, directory, step = params_io.read_config(path)
    hf.apply_overrides(config, overrides or {})
    sizes = mesh_lib.resolve_mesh_shape(config.mesh, jax.device_count())
    hf.apply_overrides(config, fit_to_ring(config, sizes[mesh_lib.SP]))
    return make_runner(config, lambda abstract, shardings: params_io.restore(directory, step, abstract, shardings))
