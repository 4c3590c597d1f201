"""The optimizer of a run: the learning-rate schedule, AdamW (with the global-norm clip and the
weight-decay mask), how many updates it has applied, and the start-up notes about what it will do
that the config does not say outright.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from longctx.model.decoder import weight_decay_mask
from longctx.train import checkpoint_compat as compat


def schedule_values(config) -> np.ndarray:
    """The numbers of the run's learning-rate schedule, float32 [peak, floor, warmup steps, decay
    steps]: the warmup at most the run, the decay ending at train.num_steps (and after the
    warmup). The train step takes them as an argument (steps.jit_steps), not as constants, so
    that one compiled step serves every run length and warmup: a run resumed to train longer
    finds its program in a persistent compilation cache."""
    o, steps = config.optimizer, config.train.num_steps
    warmup = min(o.warmup_steps, steps)
    return np.array([o.learning_rate, o.learning_rate * o.min_learning_rate_ratio, warmup,
                     max(steps, warmup + 1)], np.float32)


def learning_rate_schedule(config, values=None) -> optax.Schedule:
    """optax's warmup_cosine_decay_schedule from 0 of `values` (schedule_values(config) where
    None; traced in the train step): linear from 0 to the peak over the warmup, then half a
    cosine down to the floor at the decay's end, and the floor after it."""
    peak, floor, warmup, decay = (schedule_values(config) if values is None else values)
    alpha = jnp.where(peak == 0, 0.0, floor / jnp.where(peak == 0, 1.0, peak))

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        rising = peak * jnp.clip(count, 0.0, warmup) / jnp.maximum(warmup, 1.0)
        done = jnp.clip(count - warmup, 0.0, decay - warmup) / (decay - warmup)
        falling = peak * ((1.0 - alpha) * 0.5 * (1.0 + jnp.cos(jnp.pi * done)) + alpha)
        return jnp.where(count < warmup, rising, falling)

    return schedule


def make_optimizer(config, schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
    """AdamW (after the global-norm clip) on the run's learning-rate schedule: `schedule`, or
    learning_rate_schedule(config) where None (the train step passes one of traced numbers)."""
    o = config.optimizer
    schedule = learning_rate_schedule(config) if schedule is None else schedule
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                        weight_decay=o.weight_decay, mask=weight_decay_mask)
    if o.grad_clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(o.grad_clip_norm), adamw)


def applied_updates(opt_state) -> jax.Array:
    """How many updates the optimizer has applied: its schedule's own count, which a skipped
    (non-finite) step does not advance, unlike `TrainState.step`. The learning rate of the next
    update is `schedule(applied_updates(opt_state))`."""
    return optax.tree_utils.tree_get(
        opt_state, "count",
        filtering=lambda path, _: getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState")


# The keys `learning_rate_schedule` reads.
SCHEDULE_KEYS = ("optimizer.learning_rate", "optimizer.min_learning_rate_ratio", "optimizer.warmup_steps",
                 "train.num_steps")


def optimizer_notes(config, saved_config: dict | None = None, updates: int = 0) -> list[str]:
    """One line each, for the start-up, about what the optimizer will do that the config does not
    say outright: a warmup longer than the run (cut to the run), AdamW's moments in bfloat16, and,
    on a resume (`saved_config`: the checkpoint's, `updates`: the updates it had applied), a
    schedule that differs from the one the run started with."""
    o, t, notes = config.optimizer, config.train, []
    if o.warmup_steps > t.num_steps:
        notes.append(f"optimizer.warmup_steps={o.warmup_steps} is more than train.num_steps={t.num_steps}: "
                     f"the warmup is cut to {t.num_steps} steps, so the learning rate rises until the last "
                     f"step, never reaching optimizer.learning_rate={o.learning_rate:g}, and never decays.")
    if config.model.param_dtype == "bfloat16":
        notes.append("model.param_dtype=bfloat16: AdamW's moments are kept in bfloat16 too (optax follows "
                     "the parameters' dtype), so updates much smaller than a weight round away; "
                     "model.param_dtype=float32 keeps parameters and moments in full precision.")
    if saved_config is not None:
        changed = compat.config_differences(saved_config, config.to_dict(), SCHEDULE_KEYS)
        if changed:
            before = learning_rate_schedule(ml_collections.ConfigDict(saved_config))(updates)
            after = learning_rate_schedule(config)(updates)
            stretched = (f"its cosine decay is re-stretched to end at step {t.num_steps}, and "
                         if any(d.startswith("train.num_steps") for d in changed) else "")
            notes.append(f"the learning-rate schedule differs from the checkpoint's ({'; '.join(changed)}): "
                         f"{stretched}the rate of update {updates + 1} is {float(after):.3g}, where the "
                         f"checkpoint's schedule had {float(before):.3g}.")
    return notes
