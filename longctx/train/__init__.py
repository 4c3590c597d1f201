"""A training run. Its one entry point is `train_and_evaluate(config, workdir, *, evaluators=())`
(loop.py). By job:
  optimizer.py   the learning-rate schedule, AdamW, the optimizer's start-up notes
  state.py       TrainState, its shardings, Setup / make_setup, the abstract state with shardings,
                 the run's concrete sequence layout
  steps.py       the pure train and eval steps, jitted with explicit shardings; validation loss
  hooks.py       the Evaluator protocol: evaluations the loop is handed and runs every N steps
  loop.py        start-up checks, the loop (logging, evaluation, saving, stopping), run_info.json
  checkpoint.py, checkpoint_compat.py   checkpoints, and what one must agree with to be restored
  metrics.py     the metrics files
  workdir.py, lease.py   the run directory and the one-run-per-workdir lease

Imports: longctx.model, longctx.data, longctx.ops, longctx.parallel, longctx.config, longctx.cli,
longctx.errors. Evaluations that need the run's parameters (the passkey evaluator of
longctx.evals) reach the loop as hooks it is given (hooks.py), never by an import from here.

`train_and_evaluate` is imported lazily, so that `longctx.train.lease` (and workdir) start without
importing jax, which the lease does not need.
"""

import importlib

__all__ = ["train_and_evaluate"]


def __getattr__(name):
    if name == "train_and_evaluate":
        return importlib.import_module("longctx.train.loop").train_and_evaluate
    raise AttributeError(f"module 'longctx.train' has no attribute {name!r}")
