"""Where metrics come from and go: the window of steps since the last log line, and
`workdir/metrics.jsonl` (one JSON object per logged step) plus TensorBoard.

Only process 0 writes; other processes get a writer that does nothing, so the training loop never
branches on the process index. A write that fails (a full disk) is a RunError naming the file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import tempfile
import time
from typing import Mapping

import jax
import numpy as np
from tensorboardX import summary
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import RecordWriter

from longctx import cli, errors
from longctx.train import workdir as workdir_lib


class MetricsWriter:
    """`resume_step`: the step this run starts from. Rows a previous run logged after it (steps
    that are about to be trained again) are dropped, so a resumed run's metrics read as one run."""

    def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._jsonl = None
        self._tb = None
        self._failed = False  # a write failed and was raised
        if self.enabled:
            directory = workdir_lib.resolve(workdir)
            self._jsonl_path = directory / "metrics.jsonl"
            with self._reporting_failed_write(self._jsonl_path):
                self._open_jsonl(workdir, directory, resume_step)
            # TensorBoard event files need appends too: for a bucket they stay on this host.
            self._tb_dir = (os.path.join(tempfile.gettempdir(), "longctx_tensorboard", directory.name)
                            if workdir_lib.is_remote(workdir) else str(directory / "tensorboard"))
            with self._reporting_failed_write(self._tb_dir):
                self._tb = EventFile(self._tb_dir, first_step=resume_step + 1)

    def _open_jsonl(self, workdir: str, directory, resume_step: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
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

    def write(self, step: int, metrics: Mapping[str, object], *, prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{f"{prefix}{k}": v for k, v in metrics.items()}}
        line = json.dumps(record) + "\n"
        with self._reporting_failed_write(self._jsonl_path):
            if self._jsonl is not None:
                self._jsonl.write(line)
            else:
                self._remote_lines += line
                self._jsonl_path.write_text(self._remote_lines)
        with self._reporting_failed_write(self._tb_dir):
            self._tb.add_scalars(step, {key: value for key, value in record.items() if key != "step" and
                                        isinstance(value, (int, float)) and not isinstance(value, bool)})

    def close(self) -> None:
        """Closes both files, the second also when the first fails. A failed close is raised
        unless a write already failed (the first error is the one the user sees)."""
        if self.enabled:
            try:
                if self._jsonl is not None:
                    with self._reporting_failed_write(self._jsonl_path):
                        self._jsonl.close()
            finally:
                with self._reporting_failed_write(self._tb_dir):
                    self._tb.close()

    @contextlib.contextmanager
    def _reporting_failed_write(self, path):
        try:
            yield
        except OSError as e:
            if self._failed:
                return  # a write failed and was raised: closing what it left behind fails the same way
            self._failed = True
            raise errors.RunError(
                f"could not write metrics to {path} ({errors.os_reason(e)}). "
                f"{errors.WRITE_FAILED_ADVICE}: it resumes from its newest complete checkpoint.") from e


_EVENT_FILES = itertools.count()


class _NonFiniteScalarWarnings(logging.Filter):
    """tensorboardX warns "NaN or Inf found in input tensor." for every non-finite scalar it is
    given, once per logged step of a run that skips such steps; the log line already counts them
    (nonfinite_steps). Kept with LONGCTX_DEBUG=1 (`--verbose`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return cli.debug_enabled() or not record.getMessage().startswith("NaN or Inf found")


_NON_FINITE_SCALAR_WARNINGS = _NonFiniteScalarWarnings()


class EventFile:
    """One TensorBoard event file of scalars, written on the caller's thread and flushed at each
    logged step. (tensorboardX's SummaryWriter writes from a thread of its own and retries a failed
    flush in an exit hook, so a full disk reached the user as tracebacks from both; here a failed
    write is an OSError where it happens, and a failed close still closes the file.)"""

    def __init__(self, directory: str, *, first_step: int):
        os.makedirs(directory, exist_ok=True)
        logging.getLogger("tensorboardX.x2num").addFilter(_NON_FINITE_SCALAR_WARNINGS)  # (a set: once)
        # Unique per writer: two writers in one process within a second (a run resumed in the
        # same process) would otherwise share a name, and the second would truncate the first.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_EVENT_FILES)}"
        self._records = RecordWriter(os.path.join(directory, name))
        # The version record first, as TensorBoard expects; a session START at `first_step` hides
        # the events a previous run wrote from that step on (what SummaryWriter's purge_step does).
        now = time.time()
        self._write(Event(wall_time=now, step=first_step, file_version="brain.Event:2"))
        self._write(Event(wall_time=now, step=first_step, session_log=SessionLog(status=SessionLog.START)))
        self._records.flush()

    def add_scalars(self, step: int, values: Mapping[str, float]) -> None:
        now = time.time()
        for tag, value in values.items():
            self._write(Event(wall_time=now, step=int(step), summary=summary.scalar(tag, value)))
        self._records.flush()

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())

    def close(self) -> None:
        self._records.close()  # a buffered file closes even when its last flush fails


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
    clock, which evaluation restarts so that it is not counted; the attention pairs each step's
    batch kept (model/flops.py, counted on the host) are averaged over the same steps, for MFU."""

    def __init__(self, step: int, now: float):
        self._entries: list = []  # (step, loss, grad_norm), device scalars until read
        self._host: list = []  # the same, read
        self._streak: tuple[int, tuple] | None = None  # the non-finite steps that end those read
        self._pairs: dict[int, int] = {}  # step -> attention pairs of its batch
        self.restart_clock(step, now)

    def add(self, step: int, metrics: Mapping, attention_pairs: int | None = None) -> None:
        self._entries.append((step, metrics["loss"], metrics["grad_norm"]))
        if attention_pairs is not None:
            self._pairs[step] = attention_pairs

    def restart_clock(self, step: int, now: float) -> None:
        self._clock_step, self._clock_time = step, now

    def _read(self) -> None:
        if self._entries:
            values = jax.device_get([(loss, grad_norm) for _, loss, grad_norm in self._entries])
            read = [(step, float(loss), float(g)) for (step, _, _), (loss, g) in zip(self._entries, values)]
            self._host += read
            self._entries = []
            for entry in read:  # (across windows: a log line does not end a streak)
                finite = np.isfinite(entry[1]) and np.isfinite(entry[2])
                self._streak = None if finite else ((self._streak or (0,))[0] + 1, entry)

    def nonfinite_streak(self) -> tuple[int, tuple[int, float, float]] | None:
        """(how many, (step, loss, grad norm) of the last) of the non-finite steps in a row that
        end the steps added so far, over every window; None when the last step was finite."""
        self._read()
        return self._streak

    def first_nonfinite(self) -> tuple[int, float, float] | None:
        """(step, loss, grad norm) of the window's first step whose loss or gradient is not finite."""
        self._read()
        return next(((s, loss, g) for s, loss, g in self._host
                     if not (np.isfinite(loss) and np.isfinite(g))), None)

    def close(self, step: int, now: float, *, timed: bool) -> dict:
        """The window's summary, and a new window from `step`: mean loss over its finite steps,
        how many steps it held and how many were non-finite, and the time per step and the mean
        attention pairs per step over the same steps (when timed)."""
        self._read()
        losses = np.array([loss for _, loss, g in self._host if np.isfinite(loss) and np.isfinite(g)])
        out = {"loss": float(losses.mean()) if losses.size else float("nan"),
               "loss_window_steps": len(self._host), "nonfinite_steps": len(self._host) - losses.size}
        if timed and step > self._clock_step:
            out["step_time_s"] = (now - self._clock_time) / (step - self._clock_step)
            timed_pairs = [p for s, p in self._pairs.items() if self._clock_step < s <= step]
            if timed_pairs:
                out["attention_pairs"] = float(np.mean(timed_pairs))
        self._host = []
        self._pairs = {}
        self.restart_clock(step, now)
        return out
