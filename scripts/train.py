"""Train a longctx model: flags -> config -> longctx.train.train_and_evaluate (with the passkey
evaluator of longctx.evals.needle when --config.train.eval_needle_every > 0, RULER's of
longctx.evals.ruler when --config.train.eval_ruler_every > 0). With
--config.attention.cp=auto the planner (longctx.plan.auto) chooses the strategy and the mesh's -1
axes first (with --config.attention.block_size=auto the block), says what it chose in one line and
records its best rows in run_info.json. A train step the compiler refuses for lack of memory
stops the run before its first step with one line: the memory, the bytes, and the nearest change
that fits (longctx.plan.fit_remedy).

  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/demo
  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/x --config.model.num_layers=4

Off TPU, set LONGCTX_CPU_DEVICES=N (default 8 when no accelerator is found) to run on N virtual
CPU devices. A failure prints one line (`longctx: ...`; exit status 2 for bad input, 1 for a run
that failed); `--verbose` or LONGCTX_DEBUG=1 adds the traceback.
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import jax  # noqa: E402

from longctx import train  # noqa: E402
from longctx.evals import needle  # noqa: E402
from longctx.evals import ruler  # noqa: E402
from longctx.parallel import mesh as mesh_lib  # noqa: E402
from longctx.plan import auto, fit_remedy  # noqa: E402

# Rows of the planner's table run_info.json keeps when the planner chose (an auto key).
PLAN_ROWS_KEPT = 5

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    config = _CONFIG.value
    mesh_lib.maybe_initialize_distributed(config.distributed)  # all hosts' devices, for the planner
    resolution = auto.resolve(config, jax.devices())  # attention.cp / block_size=auto, if asked
    config = resolution.config
    if (resolution.chosen or resolution.measured) and jax.process_index() == 0:
        print(f"longctx: {auto.describe(resolution)}", flush=True)
    run_info = resolution.run_info(PLAN_ROWS_KEPT)
    run_info["predicted"] = auto.prediction(config, jax.devices())  # None off the planner's chips
    # The loop runs evaluations it is given; it never imports them (they live above it).
    evaluators = [e for e in (needle.PASSKEY_EVALUATOR, ruler.RULER_EVALUATOR) if e.every(config) > 0]
    # A step the compiler refuses for lack of memory is one line with the planner's nearest fit.
    advice = lambda config, oom: fit_remedy.out_of_memory_advice(config, oom, jax.devices())  # noqa: E731
    train.train_and_evaluate(config, _WORKDIR.value, evaluators=evaluators, run_info=run_info,
                             memory_advice=advice)


if __name__ == "__main__":
    cli.run_absl(main)
