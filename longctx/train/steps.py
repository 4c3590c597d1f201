"""The step functions: the pure `train_step(state, batch, schedule) -> (state, metrics)` and the
eval step, both jitted once with explicit shardings (`jit_steps`: the train step with the run's
schedule bound, `TrainStep`), and `evaluate`, the validation loss over a few batches and by
in-document position.

Shapes: every batch array is int32 [global_batch, seq_len], batch sharded over (dp, fsdp) and the
sequence over sp, tokens already in the ring layout (the data pipeline permuted them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from longctx.data import packing
from longctx.model.decoder import model_nll
from longctx.parallel import mesh as mesh_lib
from longctx.train.optimizer import (applied_updates, learning_rate_schedule, make_optimizer,
                                     schedule_values)
from longctx.train.state import Setup, TrainState, abstract_with_shardings

BATCH_KEYS = packing.KEYS  # the arrays of a packed batch, each [global_batch, seq_len]


def _masked_loss(graphdef, params, batch, count=None):
    """The batch's mean NLL over its loss tokens, or its summed NLL over `count` (a micro-batch's
    share of a whole batch's mean); (nll [b, S], the batch's own loss tokens) beside."""
    nll = model_nll(nnx.merge(graphdef, params), batch)
    weights = batch["loss_mask"].astype(jnp.float32)
    total, own = jnp.sum(nll * weights), jnp.sum(weights)
    return total / jnp.maximum(own if count is None else count, 1.0), (nll, own)


def grad_accum_steps(config) -> int:
    """train.grad_accum_steps (1 in configs saved before it existed)."""
    return int(config.train.get("grad_accum_steps", 1))


def micro_batches(batch, steps: int):
    """A batch of [B, S] arrays as `steps` micro-batches [steps, B / steps, S]: micro-batch k holds
    rows k, k + steps, k + 2 * steps, ..., so that each device's rows (a contiguous run of the
    batch axis, split over dp x fsdp) give every micro-batch its share without moving."""
    spec = mesh_lib.logical_to_spec((None, "activation_batch", "activation_length"))

    def split(x):
        b, seq_len = x.shape
        return jax.lax.with_sharding_constraint(jnp.swapaxes(x.reshape(b // steps, steps, seq_len), 0, 1), spec)

    return jax.tree.map(split, batch)


def _loss_and_grads(graphdef, params, batch, accum: int, param_shardings):
    """(mean NLL over the batch's loss tokens, (its loss tokens), gradients): one pass, or `accum`
    micro-batches under a scan whose float32 gradients add up to the one pass's (each micro-batch's
    NLL is summed over the whole batch's loss tokens, so no token weighs more than another)."""
    grad_fn = jax.value_and_grad(_masked_loss, argnums=1, has_aux=True)
    if accum == 1:
        (loss, (_, count)), grads = grad_fn(graphdef, params, batch)
        return loss, count, grads
    count = jnp.sum(batch["loss_mask"].astype(jnp.float32))

    def add(summed, micro):
        loss, grads = summed
        (part, _), g = grad_fn(graphdef, params, micro, count)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return (loss + part, jax.lax.with_sharding_constraint(grads, param_shardings)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (loss, grads), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), zeros), micro_batches(batch, accum))
    return loss, count, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def make_train_step(config, setup: Setup):
    """The pure `train_step(state, batch, schedule) -> (state, metrics)`: one optimizer update on
    the whole batch, its gradients accumulated over train.grad_accum_steps micro-batches, at the
    learning rate of `schedule` (optimizer.schedule_values)."""
    skip_nonfinite = config.train.on_nonfinite == "skip"
    accum = grad_accum_steps(config)

    def train_step(state: TrainState, batch, schedule) -> tuple[TrainState, dict]:
        loss, count, grads = _loss_and_grads(setup.graphdef, state.params, batch, accum,
                                             setup.state_shardings.params)
        learning_rate = learning_rate_schedule(config, schedule)
        optimizer = make_optimizer(config, learning_rate)  # setup.optimizer's, its numbers traced
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.global_norm(grads)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
            new_state = kept.replace(step=state.step + 1)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": count,
                   "learning_rate": learning_rate(applied_updates(state.opt_state))}
        return new_state, metrics

    return train_step


def num_position_buckets(seq_len: int) -> int:
    """Log-spaced buckets of in-document position: [0,1), [1,3), [3,7), ... up to seq_len."""
    return int(math.ceil(math.log2(seq_len + 1)))


def make_eval_step(config, setup: Setup):
    """`eval_step(params, batch)` -> summed NLL and counts, overall and by position bucket (over
    train.grad_accum_steps micro-batches, as the train step holds them)."""
    n_buckets = num_position_buckets(config.data.seq_len)
    accum = grad_accum_steps(config)

    def sums(params, batch):
        _, (nll, count) = _masked_loss(setup.graphdef, params, batch)
        weights = batch["loss_mask"].astype(jnp.float32)
        bucket = jnp.floor(jnp.log2(batch["positions"].astype(jnp.float32) + 1.0)).astype(jnp.int32)
        bucket = jnp.clip(bucket, 0, n_buckets - 1).reshape(-1)
        by_position = jax.ops.segment_sum((nll * weights).reshape(-1), bucket, n_buckets)
        by_position_count = jax.ops.segment_sum(weights.reshape(-1), bucket, n_buckets)
        return {"nll_sum": jnp.sum(nll * weights), "count": count,
                "nll_by_position": by_position, "count_by_position": by_position_count}

    def eval_step(params, batch):
        if accum == 1:
            return sums(params, batch)
        parts = jax.lax.map(lambda micro: sums(params, micro), micro_batches(batch, accum))
        return jax.tree.map(lambda x: jnp.sum(x, axis=0), parts)

    return eval_step


def abstract_batch(config, setup: Setup) -> dict:
    """The batch the train step is compiled for: int32 [global_batch, seq_len] arrays, sharded as
    the data pipeline delivers them."""
    shape = (config.data.global_batch_size, config.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sharding) for k in BATCH_KEYS}


def compile_ahead(train_step, config, setup: Setup):
    """The jitted `train_step` compiled for the run's state and batch before any step runs, so
    that a program the compiler refuses (out of memory) fails before anything is trained or
    written. The step's calls then use this executable (jit's cache holds it: one compile)."""
    state = abstract_with_shardings(setup.abstract_state, setup.state_shardings)
    return train_step.lower(state, abstract_batch(config, setup)).compile()


class TrainStep:
    """The jitted train step with the run's schedule bound: `step(state, batch)`, and
    `step.lower(state, batch)` or `step.compiled(...)` to compile it ahead. The schedule's numbers
    are an argument of the program, not constants in it (optimizer.schedule_values), so runs that
    differ only in their length or warmup share one program."""

    def __init__(self, jitted, values: np.ndarray, sharding: NamedSharding):
        self.jitted, self._values, self._sharding = jitted, values, sharding
        self._placed = None

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        return self.jitted(state, batch, self._on_devices())

    def lower(self, state, batch):
        values = jax.ShapeDtypeStruct(self._values.shape, self._values.dtype,
                                      sharding=self._sharding)
        return self.jitted.lower(state, batch, values)

    def compiled(self, state, batch, compiler_options=None):
        """The step compiled ahead with `compiler_options`, called as step(state, batch)."""
        executable = self.lower(state, batch).compile(compiler_options)
        return lambda state, batch: executable(state, batch, self._on_devices())

    def _on_devices(self):
        if self._placed is None:  # every process holds the same numbers
            self._placed = jax.make_array_from_callback(
                self._values.shape, self._sharding, lambda index: self._values[index])
        return self._placed


def jit_steps(config, setup: Setup):
    """The train step jitted once with explicit shardings and the state donated; and the eval step."""
    replicated = NamedSharding(setup.batch_sharding.mesh, PartitionSpec())
    batch_shardings = {k: setup.batch_sharding for k in BATCH_KEYS}
    jitted = jax.jit(make_train_step(config, setup),
                     in_shardings=(setup.state_shardings, batch_shardings, replicated),
                     out_shardings=(setup.state_shardings, replicated), donate_argnums=0)
    train_step = TrainStep(jitted, schedule_values(config), replicated)
    eval_step = jax.jit(make_eval_step(config, setup),
                        in_shardings=(setup.state_shardings.params, batch_shardings),
                        out_shardings=replicated)
    return train_step, eval_step


def evaluate(config, eval_step, params, make_iterator) -> dict:
    """Validation loss over the first `eval_steps` batches, and loss by in-document position."""
    totals = None
    iterator = make_iterator()
    try:
        for _ in range(config.train.eval_steps):
            try:
                batch = next(iterator)
            except StopIteration:
                break
            out = jax.device_get(eval_step(params, batch))
            totals = out if totals is None else jax.tree.map(np.add, totals, out)
    finally:
        iterator.close()  # its prefetch thread would otherwise outlive every evaluation
    if totals is None:
        return {}
    counts = np.maximum(totals["count_by_position"], 1.0)
    by_position = np.where(totals["count_by_position"] > 0, totals["nll_by_position"] / counts, np.nan)
    # the tokens behind each bucket's loss, so that a range of buckets can be averaged
    # (scripts/ablate.py: the loss past a window)
    return {"loss": float(totals["nll_sum"] / max(totals["count"], 1.0)),
            "loss_by_position": [None if np.isnan(x) else float(x) for x in by_position],
            "position_bucket_starts": [2 ** i - 1 for i in range(len(by_position))],
            "tokens_by_position": [int(x) for x in totals["count_by_position"]]}
