"""The failures longctx reports to a person as one sentence, without a traceback.

Every error a user can cause or fix (a bad config, data file, checkpoint directory or workdir; a
run stopped for a non-finite loss; a save that could not be written) is a `LongctxError` whose
message names the file, key or step and what to do. Entry points print `longctx: <message>` and
exit non-zero; a traceback is shown only with `--verbose` or `LONGCTX_DEBUG=1`. `first_line` and
`os_reason` put a wrapped library error into such a message.
"""

import errno
import os
import re


class LongctxError(Exception):
    """A failure with a message meant for the user; scripts print it as one line."""


class ConfigError(LongctxError, ValueError):
    """Input that cannot run (config, data, checkpoint directory, workdir, mesh); names the key."""


class RunError(LongctxError):
    """A run that started and had to stop (non-finite loss, a save that failed); names the step."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or directory the input names does not exist (also a FileNotFoundError)."""


# What to do when a write into the workdir failed (a full disk, mostly): said the same way by the
# checkpointer and the metrics writer, each after its own "could not write ..." and what resumes.
WRITE_FAILED_ADVICE = "Free space there (or point the run at another workdir) and start it again"
# The same when the write was refused (no permission, an immutable directory, a read-only mount),
# where "Free space there" would send the user the wrong way; `write_failed_advice` chooses.
WRITABLE_HOW = "ls -ld and lsattr -d show its owner, mode and immutable flag"
WRITE_DENIED_ADVICE = (f"Make it writable ({WRITABLE_HOW}) or point the run at another workdir, and "
                       "start it again")
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def first_line(error: BaseException) -> str:
    """One line about an error: its root cause's first line (Orbax wraps TensorStore's errors, whose
    own message names the file and what is wrong with it, in a long dump of the array spec)."""
    seen = []
    while error is not None and error not in seen and len(seen) < 10:
        seen.append(error)
        error = error.__cause__ or error.__context__
    root = seen[-1]
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0][:400] if lines else ''}"


def os_errno(error: BaseException) -> int | None:
    """The operating system's error number of a failed write, from an OSError or
    TensorStore's `[os_error_code='28']`, or None."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno:
            return e.errno
    code = re.search(r"os_error_code='?(\d+)", str(error))
    return int(code.group(1)) if code else None


def os_reason(error: BaseException) -> str:
    """The operating system's reason when a failed write has one ("No space left on device"), from
    an OSError or from TensorStore's `[os_error_code='28']`; else the root cause's first line."""
    code = os_errno(error)
    return f"{os.strerror(code)} (errno {code})" if code else first_line(error)


def write_failed_advice(error: BaseException) -> str:
    """WRITE_DENIED_ADVICE for a write refused (EACCES, EPERM, EROFS), else WRITE_FAILED_ADVICE."""
    return WRITE_DENIED_ADVICE if os_errno(error) in _DENIED else WRITE_FAILED_ADVICE
