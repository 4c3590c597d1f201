"""The failures longctx reports to a person as one sentence, without a traceback.

Every error a user can cause or fix (a bad config, data file, checkpoint directory or workdir; a
run stopped for a non-finite loss; a save that could not be written) is a `LongctxError` whose
message names the file, key or step and what to do. Entry points print `longctx: <message>` and
exit non-zero; a traceback is shown only with `--verbose` or `LONGCTX_DEBUG=1`. `first_line` and
`os_reason` put a wrapped library error into such a message.
"""

import dataclasses
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


class OutOfMemoryError(ConfigError):
    """A train step the compiler refused for lack of device memory, before any step ran: the
    message says which memory, the bytes, and the nearest change that fits."""


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


# ----------------------------------------------------------------------------- out of memory

HBM, SCOPED_VMEM = "HBM", "scoped VMEM"
_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_SIZE = r"([\d.]+)([KMGT]?)i?B?"
# The TPU compiler's messages (libtpu): the temporaries alone over HBM ("Ran out of memory on HBM,
# the total memory required for HLO temporaries (21.45G) exceeds available HBM (15.75G)"); the
# whole program over a memory space (E1000 CompileTimeHbmOom: "Ran out of memory in memory space
# hbm. Used 15.88G of 15.75G hbm."); one kernel's scoped allocation over its limit (E1001
# CompileTimeScopedVmemOom: "Scoped allocation with size 18.00M and limit 16.00M exceeded scoped
# vmem limit by 2.00M").
_TEMPORARIES = re.compile(rf"HLO temporaries \({_SIZE}\).*?available HBM \({_SIZE}\)", re.S)
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} (hbm|vmem)\b", re.I)
_SCOPED = re.compile(rf"Scoped allocation with size {_SIZE} and limit {_SIZE}", re.I)


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """What an out-of-memory compile said: which memory (HBM or SCOPED_VMEM), the bytes it needed
    and had, and what those bytes count: "temporaries" (the program's temporaries alone, without
    its arguments), "program" (everything) or "kernel" (one kernel's scoped allocation)."""

    memory: str
    needed: int
    available: int
    counts: str


def byte_size(n: float) -> str:
    """Bytes in words: "21.45 GiB", "18.00 MiB", "512.00 KiB", "100 B"."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def out_of_memory(message: str) -> OutOfMemory | None:
    """The compiler's out-of-memory error in `message` (a JaxRuntimeError's text), or None."""
    if "RESOURCE_EXHAUSTED" not in message and "Oom" not in message:
        return None
    m = _SCOPED.search(message)
    if m:
        return OutOfMemory(SCOPED_VMEM, _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4)), "kernel")
    m = _TEMPORARIES.search(message)
    if m:
        return OutOfMemory(HBM, _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4)), "temporaries")
    m = _USED.search(message)
    if m:
        memory = HBM if m.group(5).lower() == "hbm" else SCOPED_VMEM
        return OutOfMemory(memory, _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4)),
                           "program" if memory == HBM else "kernel")
    return None
