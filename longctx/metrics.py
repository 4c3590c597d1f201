"""Where metrics come from and go: the window of steps since the last log line, and
`workdir/metrics.jsonl` (one JSON object per logged step) plus TensorBoard.

Only process 0 writes; other processes get a writer that does nothing, so the training loop never
branches on the process index.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Mapping

import jax
import numpy as np

from longctx import workdir as workdir_lib


class MetricsWriter:
    """`resume_step`: the step this run starts from. Rows a previous run logged after it (steps
    that are about to be trained again) are dropped, so a resumed run's metrics read as one run."""

    def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._tb = None
        if self.enabled:
            directory = workdir_lib.resolve(workdir)
            directory.mkdir(parents=True, exist_ok=True)
            self._jsonl_path = directory / "metrics.jsonl"
            # Append: a resumed run continues the same file. Buckets cannot append, so for a
            # remote workdir the file is kept in memory and rewritten whole (it is small).
            kept = _rows_up_to(self._jsonl_path.read_text(), resume_step) if self._jsonl_path.exists() else ""
            self._remote_lines = None
            if workdir_lib.is_remote(workdir):
                self._remote_lines = kept
                self._jsonl_path.write_text(kept)
            else:
                rewritten = self._jsonl_path.with_name(self._jsonl_path.name + ".tmp")
                rewritten.write_text(kept)
                rewritten.replace(self._jsonl_path)  # atomic: a crash here leaves the old file whole
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
            from tensorboardX import SummaryWriter

            # TensorBoard event files need appends too: for a bucket they stay on this host.
            # purge_step hides events a previous run wrote at the steps about to be trained again.
            tb_dir = (os.path.join(tempfile.gettempdir(), "longctx_tensorboard", directory.name)
                      if workdir_lib.is_remote(workdir) else str(directory / "tensorboard"))
            self._tb = SummaryWriter(tb_dir, purge_step=resume_step + 1)

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


def _rows_up_to(text: str, step: int) -> str:
    """The JSON lines of `text` whose step is at most `step` (a torn last line is dropped too)."""
    kept = []
    for line in text.splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    return "".join(kept)


class MetricsWindow:
    """The steps since the last log line, kept on device until the loop reads them.

    Each step adds its loss and gradient norm as device scalars; they are read only at the loop's
    sync points, where it waits anyway, so the host does not synchronise on every step. Every step
    is checked for a non-finite loss or gradient before anything is saved (`first_nonfinite`), and
    the logged loss is the mean over the window (`close`). Step time is measured from the window's
    clock, which evaluation restarts so that it is not counted."""

    def __init__(self, step: int, now: float):
        self._entries: list = []  # (step, loss, grad_norm), device scalars until read
        self._host: list = []  # the same, read
        self.restart_clock(step, now)

    def add(self, step: int, metrics: Mapping) -> None:
        self._entries.append((step, metrics["loss"], metrics["grad_norm"]))

    def restart_clock(self, step: int, now: float) -> None:
        self._clock_step, self._clock_time = step, now

    def _read(self) -> None:
        if self._entries:
            values = jax.device_get([(loss, grad_norm) for _, loss, grad_norm in self._entries])
            self._host += [(step, float(loss), float(g)) for (step, _, _), (loss, g) in zip(self._entries, values)]
            self._entries = []

    def first_nonfinite(self) -> tuple[int, float, float] | None:
        """(step, loss, grad norm) of the window's first step whose loss or gradient is not finite."""
        self._read()
        return next(((s, loss, g) for s, loss, g in self._host
                     if not (np.isfinite(loss) and np.isfinite(g))), None)

    def close(self, step: int, now: float, *, timed: bool) -> dict:
        """The window's summary, and a new window from `step`: mean loss over its finite steps,
        how many steps it held and how many were non-finite, and the time per step (when timed)."""
        self._read()
        losses = np.array([loss for _, loss, g in self._host if np.isfinite(loss) and np.isfinite(g)])
        out = {"loss": float(losses.mean()) if losses.size else float("nan"),
               "loss_window_steps": len(self._host), "nonfinite_steps": len(self._host) - losses.size}
        if timed and step > self._clock_step:
            out["step_time_s"] = (now - self._clock_time) / (step - self._clock_step)
        self._host = []
        self.restart_clock(step, now)
        return out
