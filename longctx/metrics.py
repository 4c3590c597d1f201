"""Where metrics go: `workdir/metrics.jsonl` (one JSON object per logged step) and TensorBoard.

Only process 0 writes; other processes get a writer that does nothing, so the training loop never
branches on the process index.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Mapping

import jax

from longctx import workdir as workdir_lib


class MetricsWriter:
    def __init__(self, workdir: str, *, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._tb = None
        if self.enabled:
            directory = workdir_lib.resolve(workdir)
            directory.mkdir(parents=True, exist_ok=True)
            self._jsonl_path = directory / "metrics.jsonl"
            # Append: a resumed run continues the same file. Buckets cannot append, so for a
            # remote workdir the file is kept in memory and rewritten whole (it is small).
            self._remote_lines = None
            if workdir_lib.is_remote(workdir):
                self._remote_lines = self._jsonl_path.read_text() if self._jsonl_path.exists() else ""
            else:
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            # TensorBoard event files need appends too: for a bucket they stay on this host.
            tb_dir = (os.path.join(tempfile.gettempdir(), "longctx_tensorboard", directory.name)
                      if workdir_lib.is_remote(workdir) else str(directory / "tensorboard"))
            self._tb = SummaryWriter(tb_dir)

    def write(self, step: int, metrics: Mapping[str, object], *, prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{f"{prefix}{k}": v for k, v in metrics.items()}}
        line = json.dumps(record) + "\n"
        if self._jsonl is not None:
            self._jsonl.write(line)
        else:
            self._remote_lines += line
            self._jsonl_path.write_text(self._remote_lines)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            if self._jsonl is not None:
                self._jsonl.close()
            self._tb.close()
