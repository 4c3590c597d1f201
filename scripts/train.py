"""Train a longctx model: flags -> config -> longctx.train.train_and_evaluate (with the passkey
evaluator of longctx.evals.needle when --config.train.eval_needle_every > 0).

  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/demo
  .venv/bin/python scripts/train.py --config=configs/base.py:tiny --workdir=runs/x --config.model.num_layers=4

Off TPU, set LONGCTX_CPU_DEVICES=N (default 8 when no accelerator is found) to run on N virtual
CPU devices. A failure prints one line (`longctx: ...`; exit status 2 for bad input, 1 for a run
that failed); `--verbose` or LONGCTX_DEBUG=1 adds the traceback.
"""

from longctx import cli

cli.start()  # before jax is imported

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from longctx import train  # noqa: E402
from longctx.evals import needle  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    config = _CONFIG.value
    # The loop runs evaluations it is given; it never imports them (they live above it).
    evaluators = [needle.PASSKEY_EVALUATOR] if config.train.get("eval_needle_every") else []
    train.train_and_evaluate(config, _WORKDIR.value, evaluators=evaluators)


if __name__ == "__main__":
    cli.run_absl(main)
