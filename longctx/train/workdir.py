"""The run directory, local or in a bucket (gs://...), through `etils.epath`.

On a TPU pod every host writes its checkpoint shards into one shared directory, which is a bucket;
locally it is a plain path. Everything longctx writes goes through these few functions so that both
work. (gs:// needs a GCS backend for epath: `pip install gcsfs`, which the `gcs` extra installs.)
"""

from __future__ import annotations

import os
import secrets
import sys

from etils import epath

from longctx import errors


def is_remote(path: str) -> bool:
    return "://" in str(path)


def resolve(path: str) -> epath.Path:
    """An absolute epath for a local path or a URL (gs://bucket/dir stays as it is)."""
    return epath.Path(path if is_remote(path) else os.path.abspath(path))


def check_named(path: str | None, flag: str = "--workdir") -> None:
    """Refuses an empty (or blank) directory name: `--workdir=` would otherwise be the current
    directory, and a run would fill it (or a tool read it) without anyone having asked for that."""
    if not str(path or "").strip():
        raise errors.ConfigError(f"{flag} is empty: name a directory, e.g. {flag}=runs/demo.")


def check_writable(path: str, *, create: bool = True) -> str | None:
    """Creates `path` if needed and writes a probe file; returns why it failed, or None.

    The probe's name is unique per process and call (`.write_probe-p<jax process index>-<random>`):
    on a pod every host may run Python as PID 1 and probe the same shared directory at once.
    `create=False` (--validate_only) creates nothing: a local directory that does not exist yet is
    judged by the nearest one above it that does, where it would be made (the probe comes and goes).
    The reason names the path that refused and the errno ("/w/checkpoints: Operation not permitted
    (errno 1)"): a failing directory inside the workdir is not the workdir.
    """
    where = path
    try:
        directory = resolve(path)
        if directory.exists() and not directory.is_dir():
            return f"{directory} is a file, not a directory"
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        elif not is_remote(path):  # (a bucket needs no directory made before a write)
            while not directory.exists() and directory.parent != directory:
                directory = directory.parent
        where = directory
        probe = directory / probe_name()
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # noqa: BLE001  (OSError locally; assorted errors from GCS clients)
        named = getattr(e, "filename", None) or where  # (mkdir's: the level that could not be made)
        if os.path.basename(str(named)).startswith(".write_probe"):
            named = os.path.dirname(str(named))
        return file_in_the_way(path) or f"{named}: {errors.os_reason(e)}"
    return None


def probe_name() -> str:
    return f".write_probe-p{_process_index()}-{secrets.token_hex(8)}"


def _process_index() -> int:
    """jax.process_index() once jax's backends run (asking earlier would start them before
    jax.distributed is initialized); before that, the launcher's LONGCTX_PROCESS_ID."""
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge  # lazily: only once jax is imported anyway

            if xla_bridge.backends_are_initialized():
                return int(sys.modules["jax"].process_index())
        except Exception:  # noqa: BLE001  (private API moved: the random part keeps names apart)
            pass
    try:
        return int(os.environ.get("LONGCTX_PROCESS_ID", 0))
    except ValueError:
        return 0


def file_in_the_way(path: str) -> str | None:
    """'<file> is a file, not a directory' when `path` or a parent of it is a file (local paths)."""
    if is_remote(path):
        return None
    p = os.path.abspath(path)
    while True:
        if os.path.isfile(p):
            return f"{p} is a file, not a directory"
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def move(source: epath.Path, destination: epath.Path) -> None:
    """Moves a directory (a checkpoint step) without deleting anything on failure."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    source.rename(destination)
