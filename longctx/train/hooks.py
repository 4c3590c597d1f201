"""What the loop runs that it does not own: an `Evaluator` is an evaluation of the parameters
being trained (passkey retrieval, in longctx.evals.needle), handed to
`train_and_evaluate(config, workdir, evaluators=[...])` by its caller. The loop never imports
the evaluation (it lives higher, in longctx.evals, and pulls in tokenizers and plotting); it
builds each evaluator once at start-up from the run's `RunContext`, then calls it every
`config.train.<every_key>` steps and logs what it returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import ml_collections

from longctx.errors import ConfigError
from longctx.train.state import Setup

# The train.* keys that ask for an evaluator, and what to pass when it is missing.
EVERY_KEYS = {"eval_needle_every": "longctx.evals.needle.PASSKEY_EVALUATOR",
              "eval_ruler_every": "longctx.evals.ruler.RULER_EVALUATOR"}


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The run as an evaluator sees it at start-up (after the state is set up, before the loop)."""

    config: ml_collections.ConfigDict
    setup: Setup  # the model's structure and shardings; parameters come with each call
    mesh: Any
    layout: str  # the concrete sequence layout (never "auto")
    data_dir: str
    workdir: str


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """An evaluation run every `config.train[every_key]` steps (0 or absent: never).

    `build(context)` is called once, at start-up, and returns `evaluate(params, step) -> metrics`;
    the loop writes the metrics to metrics.jsonl under `prefix/` and prints `log_line(metrics)`.
    The time it takes is left out of the step-time figures."""

    every_key: str
    prefix: str
    build: Callable[[RunContext], Callable[[Any, int], dict]]
    log_line: Callable[[dict], str]

    def every(self, config) -> int:
        return int(config.train.get(self.every_key) or 0)


def check_evaluators(config, evaluators: Sequence[Evaluator]) -> None:
    """Raises if the config asks for an evaluation that no evaluator given serves."""
    served = {e.every_key for e in evaluators}
    for key, fix in EVERY_KEYS.items():
        if config.train.get(key) and key not in served:
            raise ConfigError(
                f"train.{key}={config.train[key]} needs its evaluator: pass evaluators=[{fix}] to "
                f"train_and_evaluate (scripts/train.py does), or set train.{key}=0.")
