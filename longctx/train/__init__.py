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
"""

from longctx.train.loop import train_and_evaluate

__all__ = ["train_and_evaluate"]
