"""Train a longctx model: flags -> config -> longctx.train.train_and_evaluate.

  python scripts/train.py --config=configs/base.py:tiny --workdir=runs/demo
  python scripts/train.py --config=configs/base.py:tiny --workdir=runs/x --config.model.num_layers=4

Off TPU, set LONGCTX_CPU_DEVICES=N (default 8 when no accelerator is found) to run on N virtual
CPU devices.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from longctx import platform  # noqa: E402  (sets XLA_FLAGS before jax is imported)

platform.configure_cpu_devices()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from longctx import config as config_lib  # noqa: E402
from longctx import train  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:tiny.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
    try:
        train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except config_lib.ConfigError as e:
        sys.exit(f"longctx: bad input: {e}")


if __name__ == "__main__":
    app.run(main)
