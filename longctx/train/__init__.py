"""A training run: the loop and its entry point `train_and_evaluate(config, workdir)` (loop.py),
checkpoints and what a checkpoint must agree with to be restored (checkpoint.py,
checkpoint_compat.py), the metrics files (metrics.py), the run directory and the one-run-per-
workdir lease (workdir.py, lease.py).

Imports: longctx.model, longctx.data, longctx.ops, longctx.parallel, longctx.config, longctx.cli,
longctx.errors. Evaluations that need the run's parameters (the passkey evaluator of
longctx.evals) reach the loop as hooks it is given, never by an import from here.
"""

from longctx.train.loop import train_and_evaluate

__all__ = ["train_and_evaluate"]
