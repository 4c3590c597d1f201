"""Output directories that appear whole or not at all (the exporters' `--out`).

An export written straight into its destination can fail halfway (a full disk, a bad tensor) and
leave half a model, or land beside an older export's files: a stale model.safetensors that
transformers loads while the new index points elsewhere. So an exporter

  1. checks the destination first (`check_destination`): absent or empty, or an export (it holds
     MARKER, which every export carries) and `overwrite` given: replacing a directory of the
     user's own files would delete them, so that is refused however it is asked for (as
     prepare_data refuses an --output that is not a dataset);
  2. writes everything into a fresh sibling directory (`staged`), the same file system, with
     MARKER beside the export's files, so that
  3. a rename puts it in place; with `overwrite`, the old directory is renamed aside first and
     deleted only once the new one is in place (a failure at any point leaves the old export
     intact and removes the partial one).

Files are made 0644 and the directory 0755 (a temporary directory is created 0700; an export is
meant to be read by others, e.g. a serving job running as another user).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator

import longctx
from longctx.errors import ConfigError

FILE_MODE, DIRECTORY_MODE = 0o644, 0o755
# What marks a directory as an export, which --overwrite may replace (transformers and Orbax
# ignore a file they do not know).
MARKER = "longctx_export.json"


def _is_used(directory: str) -> bool:
    return os.path.isdir(directory) and bool(os.listdir(directory))


def is_export(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MARKER))


def check_destination(directory: str, overwrite: bool, flag: str = "--out",
                      source: tuple[str, str] | None = None) -> None:
    """Raises ConfigError when `directory` cannot take a new export (say it before any work; the
    scripts' --validate_only calls it too). `source` (flag, path): what the export reads, which
    replacing `directory` must not delete."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{flag}={directory} is a file, not a directory.")
    if source is not None and "://" not in source[1]:
        out, read = os.path.realpath(directory), os.path.realpath(source[1])
        if read == out or read.startswith(out.rstrip(os.sep) + os.sep):
            raise ConfigError(f"{flag}={directory} holds {source[0]}={source[1]}, which replacing it would "
                              f"delete; choose another {flag}.")
    if _is_used(directory) and not is_export(directory):
        raise ConfigError(f"{flag}={directory} holds files that are not a longctx export (no {MARKER}), "
                          f"which longctx never deletes, with --overwrite or without; choose another {flag}.")
    if _is_used(directory) and not overwrite:
        raise ConfigError(f"{flag}={directory} is not empty; pass --overwrite to replace it (the old "
                          "contents are kept until the new ones are complete).")


def _set_modes(root: str) -> None:
    for path, directories, files in os.walk(root):
        os.chmod(path, DIRECTORY_MODE)
        for name in files:
            os.chmod(os.path.join(path, name), FILE_MODE)


@contextlib.contextmanager
def staged(directory: str, overwrite: bool, flag: str = "--out") -> Iterator[str]:
    """Yields an empty sibling of `directory` to write into; on a clean exit it replaces
    `directory` (see the module docstring); on an exception it is removed and `directory` is
    untouched."""
    check_destination(directory, overwrite, flag)
    directory = os.path.abspath(directory)
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent)
    try:
        yield staging
        with open(os.path.join(staging, MARKER), "w") as f:
            json.dump({"written_by": "longctx", "longctx_version": longctx.__version__}, f)
        _set_modes(staging)
        _put_in_place(staging, directory, overwrite, flag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _put_in_place(staging: str, directory: str, overwrite: bool, flag: str) -> None:
    check_destination(directory, overwrite, flag)  # (again: something may have written there meanwhile)
    if not os.path.exists(directory):
        os.rename(staging, directory)
        return
    if not os.listdir(directory):
        os.rmdir(directory)
        os.rename(staging, directory)
        return
    parent, name = os.path.split(directory)
    old = tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent)
    os.rmdir(old)  # (only its unique name is wanted)
    os.rename(directory, old)
    try:
        os.rename(staging, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    shutil.rmtree(old, ignore_errors=True)
