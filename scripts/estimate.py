"""Will it fit? Compiles the whole train step ahead of time for a TPU topology and reports memory.

  python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --topology=v5p:4x4x4
  python scripts/estimate.py --config=configs/base.py:llama3_8b_128k --topology=v5e:8x8 \\
      --config.mesh.sp=32 --config.model.remat_policy=nothing_saveable
  python scripts/estimate.py --config=configs/base.py:tiny --topology=v5p:2x2x2 --json

Runs on any machine with `libtpu` installed (the [tpu] extra): the model, the ring-splash Mosaic
kernels and the optimizer go through the real TPU compiler for the named topology (v4, v5e, v5p,
v6e, e.g. "v5p:4x4x4", "v5e:8x8"), nothing runs. Prints per-device arguments, outputs,
temporaries and total, the chip's HBM, whether it fits and, when it does not, the overrides that
should make it fit. `--json` prints the same as one JSON object. Exit status 0 fits, 1 does not
fit, 2 bad input (one sentence on stderr).

The fit table in docs/ (longest sequence per chip and sp) comes from scripts/fit_sweep.py, which
calls `estimate(config, topology)` below.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from longctx import platform  # noqa: E402  (sets XLA_FLAGS before jax is imported)

platform.configure_cpu_devices()

import dataclasses  # noqa: E402
import json  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from longctx import aot  # noqa: E402
from longctx import config as config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/base.py:llama3_8b_128k.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology known to libtpu, e.g. v5p:4x4x4, v5e:8x8, "
                                "v6e:4x4, v4:2x2x2.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
flags.mark_flags_as_required(["config", "topology"])


def estimate(config, topology: str) -> aot.CompiledStep:
    """Compiles `config`'s train step for `topology`; ValueError (one sentence) on bad input."""
    if not aot.libtpu_available():
        raise ValueError("libtpu is not installed, so TPU programs cannot be compiled here "
                         "(pip install -e '.[tpu]').")
    try:
        return aot.compile_train_step(config, topology)
    except config_lib.ConfigError as e:
        raise ValueError(f"the config does not fit topology {topology}: {e}") from None


def result_dict(config, result: aot.CompiledStep) -> dict:
    out = dataclasses.asdict(result)
    out.pop("hlo", None)
    out.update(total_bytes=result.total_bytes, hbm_bytes=result.hbm_bytes, fits=result.fits,
               seq_len=config.data.seq_len, global_batch_size=config.data.global_batch_size,
               remat_policy=config.model.remat_policy, impl=config.attention.impl,
               remedies=aot.suggest_remedies(config, result))
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    try:
        result = estimate(config, _TOPOLOGY.value)
    except ValueError as e:
        print(f"estimate: {e}", file=sys.stderr)
        sys.exit(2)
    if _JSON.value:
        print(json.dumps(result_dict(config, result), indent=1))
    else:
        print(aot.format_report(config, result))
    sys.exit(0 if result.fits in (True, None) else 1)


if __name__ == "__main__":
    app.run(main)
