"""Forward passes outside the training loop, on the sharded model exactly as in training.

Rows come in natural order (`tokens`, and optionally `positions` and `segment_ids`, int [b, n],
checked by `check_rows`: segment ids without positions get in-document positions, as packed
training rows have them); they are padded to a sequence length the ring accepts (and with empty
rows to a multiple of dp x fsdp, dropped from the output), permuted into the run's sp layout (as
the data pipeline does), placed batch over (dp, fsdp) and sequence over sp, and run through
`longctx.model.Decoder` under the run's mesh. Logits are computed only at the positions asked
for (all of them for a logit check, a passkey's few tokens for a retrieval test), so the
[b, S, vocab] array of a long sequence is never formed unless requested.

Legend: b batch, t token (layout order), p requested position, d model width, v vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.data import pipeline
from longctx.interop import params_io
from longctx.ops import blocks
from longctx.ops import masks
from longctx.parallel import document_layout
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from longctx.train import state as train_state


@dataclasses.dataclass(frozen=True)
class Runner:
    """A model ready to run: its config, mesh, layout, parameters and the jitted forward."""

    config: Any
    mesh: Any
    layout: str
    setup: train_state.Setup
    params: Any
    forward_at: Any  # jitted (params, batch, index) -> logits

    @property
    def sp(self) -> int:
        return int(self.mesh.shape[mesh_lib.SP])

    def logits_at(self, rows: dict, where: np.ndarray) -> np.ndarray:
        """float32 logits [b, p, v] at natural positions `where` [b, p] of natural-order `rows`
        (`check_rows`; any number of rows: padded to a multiple of the mesh's dp x fsdp, the
        padding dropped from the output)."""
        rows = check_rows(rows, self.config.model.vocab_size)
        b, n = rows["tokens"].shape
        where = np.asarray(where)
        if where.ndim != 2 or where.shape[0] != b or not np.issubdtype(where.dtype, np.integer) or (
                where.size and (where.min() < 0 or where.max() >= n)):
            raise ConfigError(f"logit positions of shape {list(where.shape)} must be [{b}, p] "
                              f"integers in [0, {n}), p of them for each of the {b} rows.")
        self._check_chunks(rows)
        ways = int(self.mesh.shape[mesh_lib.DP] * self.mesh.shape[mesh_lib.FSDP])
        padded = -b % ways  # rows of padding, so that every (dp, fsdp) device holds whole rows
        if padded:
            rows = {k: np.concatenate([v, np.zeros((padded, n), np.int32)]) for k, v in rows.items()}
            where = np.concatenate([where, np.zeros((padded, where.shape[1]), where.dtype)])
        batch, perm = self._laid_out(rows)
        inverse = np.argsort(perm, axis=-1)  # [S] or per row [b, S]
        # natural position -> layout index
        index = (inverse[where] if inverse.ndim == 1 else
                 np.take_along_axis(inverse, where, axis=1)).astype(np.int32)
        index = jax.device_put(index, NamedSharding(self.mesh, PartitionSpec()))
        with jax.set_mesh(self.mesh):
            out = self.forward_at(self.params, batch, index)
        return np.asarray(jax.device_get(out))[:b]

    def _check_chunks(self, rows: dict) -> None:
        """Chunked attention with documents counts chunks from each document's start: the ring
        names a chunk by the column where it starts, column - (position mod chunk_size), which
        must lie inside the token's document in the row (so ids stay positive and distinct)."""
        a = self.config.attention
        if a.chunk_size is None or not a.use_segment_ids:
            return
        seg, pos = rows["segment_ids"], rows["positions"]
        offset = masks.segment_positions(seg)  # columns since the document's first in the row
        bad = (seg > 0) & (pos % a.chunk_size > offset)
        if bad.any():
            r, c = (int(x[0]) for x in np.nonzero(bad))
            raise ConfigError(
                f"positions: row {r}, column {c} is at position {int(pos[r, c])}, "
                f"{int(offset[r, c])} tokens into its document, so with attention.chunk_size="
                f"{a.chunk_size} its chunk would start before the document does; chunks count "
                "from each document's start: give positions that start every document at a "
                "multiple of the chunk size (0 for a whole document).")

    def _laid_out(self, rows: dict) -> tuple[dict, np.ndarray]:
        seq_len = self.config.data.seq_len
        b, n = rows["tokens"].shape
        if n > seq_len:
            raise ConfigError(f"rows of {n} tokens are longer than data.seq_len={seq_len}.")
        full = {k: np.zeros((b, seq_len), np.int32) for k in ("tokens", "positions", "segment_ids")}
        for key in full:  # segment 0 beyond n: padding, attends to nothing real
            full[key][:, :n] = rows[key]
        sharding = mesh_lib.batch_sharding(self.mesh)
        if layout_lib.per_row(self.layout):  # each row its own permutation (its documents')
            laid, perms = document_layout.permute_rows(full, self.sp, pipeline.layout_block(self.config))
            return {k: jax.device_put(v, sharding) for k, v in laid.items()}, perms
        perm = layout_lib.permutation(self.layout, seq_len, self.sp)
        return {k: jax.device_put(v[:, perm], sharding) for k, v in full.items()}, perm


_ROW_KEYS = ("tokens", "positions", "segment_ids")


def check_rows(rows: dict, vocab_size: int, source: str = "rows") -> dict:
    """int32 [b, n] `tokens`, `positions`, `segment_ids` from a caller's rows (arrays of rank 1
    or 2), or ConfigError with one sentence naming `source` and the array. Without
    `segment_ids` a row is one document; without `positions`, positions count from each
    document's start (0, 1, ... restarting wherever the segment id changes), as packed training
    rows have them."""
    if "tokens" not in rows:
        raise ConfigError(f"{source} has no 'tokens'.")
    out = {}
    for key in _ROW_KEYS:
        if rows.get(key) is None:
            continue
        value = np.asarray(rows[key])
        if value.ndim not in (1, 2):
            raise ConfigError(f"{source}: '{key}' has rank {value.ndim} (shape {list(value.shape)}); "
                              "give [batch, tokens] or [tokens].")
        if not np.issubdtype(value.dtype, np.integer):
            raise ConfigError(f"{source}: '{key}' holds {value.dtype} values; it must hold integers.")
        value = np.atleast_2d(value)
        if key != "tokens" and value.shape != out["tokens"].shape:
            raise ConfigError(f"{source}: '{key}' has shape {list(value.shape)}, 'tokens' "
                              f"{list(out['tokens'].shape)}; they must match.")
        if value.size == 0:
            raise ConfigError(f"{source}: '{key}' is empty.")
        if value.min() < 0:
            at = tuple(int(x[0]) for x in np.nonzero(value < 0))
            raise ConfigError(f"{source}: '{key}' holds {int(value[at])} at {list(at)}; it must not "
                              "be negative.")
        if key == "tokens" and value.max() >= vocab_size:
            at = tuple(int(x[0]) for x in np.nonzero(value >= vocab_size))
            raise ConfigError(f"{source}: 'tokens' holds id {int(value[at])} at {list(at)}, outside "
                              f"the model's vocabulary of {vocab_size} ids (model.vocab_size).")
        if value.max() > np.iinfo(np.int32).max:
            raise ConfigError(f"{source}: '{key}' holds {int(value.max())}, beyond int32.")
        out[key] = value.astype(np.int32)
    if "segment_ids" not in out:
        out["segment_ids"] = np.ones_like(out["tokens"])
    if "positions" not in out:
        out["positions"] = masks.segment_positions(out["segment_ids"])
    return out


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


def fit_to_ring(config, sp: int) -> dict:
    """Overrides for running a checkpoint at another length or mesh: attention.block_size shrunk
    to the largest block the ring accepts on this sequence length's shards (blocks.fit_block:
    halving; splash's blocks stay multiples of 128), train.loss_chunk_size halved until it
    divides them."""
    a, shard = config.attention, config.data.seq_len // sp
    block = blocks.fit_block(a.block_size, shard, a.impl, a.layout)
    if block is None:
        raise ConfigError(f"data.seq_len={config.data.seq_len} over sp={sp} gives shards of {shard} "
                          f"tokens, which hold no attention block of impl {a.impl!r} (at most "
                          f"{a.block_size}, a multiple of {blocks.block_multiple(a.impl)}).")
    chunk = config.train.loss_chunk_size
    while chunk > 1 and shard % chunk:
        chunk //= 2
    return {"attention.block_size": block, "train.loss_chunk_size": chunk}


def make_runner(config, params_from, mesh=None, *, setup: train_state.Setup | None = None,
                layout: str | None = None) -> Runner:
    """A Runner for `config` (validated against the devices), with parameters from
    `params_from(abstract_params, shardings)`. The training loop passes its own mesh, setup and
    layout (and its parameters later, with `dataclasses.replace`)."""
    config_lib.validate(config)
    mesh = mesh_lib.make_mesh(config.mesh) if mesh is None else mesh
    layout = layout or train_state.resolve_layout(config, int(mesh.shape[mesh_lib.SP]))
    with jax.set_mesh(mesh):
        setup = setup or train_state.make_setup(config, mesh, layout)
        params = params_from(setup.abstract_state.params, setup.state_shardings.params)
    # Replicated out: every process can read the (small) logits it asked for.
    forward_at = jax.jit(functools.partial(_forward_at, setup.graphdef),  # (closes over the model's structure)
                         out_shardings=NamedSharding(mesh, PartitionSpec()))
    return Runner(config, mesh, layout, setup, params, forward_at)


def runner_from_checkpoint(path: str, overrides: dict | None = None) -> Runner:
    """A Runner for the newest checkpoint under `path`, with its saved config changed by
    `overrides` (dotted keys: mesh, attention.impl, data.seq_len, ...)."""
    config, directory, step = params_io.read_config(path)
    config_lib.apply_overrides(config, overrides or {})
    sizes = mesh_lib.resolve_mesh_shape(config.mesh, jax.device_count())
    config_lib.apply_overrides(config, fit_to_ring(config, sizes[mesh_lib.SP]))
    return make_runner(config, lambda abstract, shardings: params_io.restore(directory, step, abstract, shardings))
