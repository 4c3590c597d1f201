"""The run directory, local or in a bucket (gs://...), through `etils.epath`.

On a TPU pod every host writes its checkpoint shards into one shared directory, which is a bucket;
locally it is a plain path. Everything longctx writes goes through these few functions so that both
work. (gs:// needs a GCS backend for epath: `pip install gcsfs`, which the `gcs` extra installs.)
"""

from __future__ import annotations

import os

from etils import epath


def is_remote(path: str) -> bool:
    return "://" in str(path)


def resolve(path: str) -> epath.Path:
    """An absolute epath for a local path or a URL (gs://bucket/dir stays as it is)."""
    return epath.Path(path if is_remote(path) else os.path.abspath(path))


def check_writable(path: str) -> str | None:
    """Creates `path` if needed and writes a probe file; returns why it failed, or None."""
    try:
        directory = resolve(path)
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # noqa: BLE001  (OSError locally; assorted errors from GCS clients)
        return getattr(e, "strerror", None) or str(e).splitlines()[0]
    return None


def move(source: epath.Path, destination: epath.Path) -> None:
    """Moves a directory (a checkpoint step) without deleting anything on failure."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    source.rename(destination)
