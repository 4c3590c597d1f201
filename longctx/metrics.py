"""Where metrics go: one line per interval on stdout, `metrics.jsonl`, and TensorBoard.

Only process 0 writes; other processes get a writer that does nothing, so the training loop never
branches on the process index.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import jax


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsWriter:
    def __init__(self, workdir: str, *, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            # Append: a resumed run continues the same file (steps already logged are not rewritten).
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, object], *, echo: bool = True, prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{f"{prefix}{k}": v for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        if echo:
            print(" ".join(f"{k}={_format(v)}" for k, v in record.items()), flush=True)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
