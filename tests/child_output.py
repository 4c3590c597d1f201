"""Reading what launch/local.py children print, when other writers share their stdout.

In a multi-process JAX job gloo's C++ logging ("[Gloo] Rank 0 is connected to 1 peer ranks. ...")
writes into each child's stdout from its own threads, in pieces, so its text can land in front of
a line the child prints, or between that line's text and its newline (print() writes the two
separately). The launcher then prefixes the spliced line once. A line the child writes in one
write() stays whole (pipe writes up to PIPE_BUF are atomic), so tests look for it anywhere after
the `[p<i>] ` prefix, never at the start of the line or as the whole line.
"""

from __future__ import annotations

import re

# Python source that starts such a writer: pieces of a line, from another thread, into fd 1, for
# as long as the process runs. Put it in front of a child's own code (it imports no jax).
FOREIGN_WRITER = """
import os as _os, threading as _threading, time as _time

def _foreign_writer():
    while True:
        _os.write(1, b"[foreign] piece ")
        _time.sleep({interval})

_threading.Thread(target=_foreign_writer, daemon=True).start()
"""


def foreign_writer(interval: float = 0.002) -> str:
    return FOREIGN_WRITER.format(interval=interval)


def find(out: str, process: int, pattern: str) -> re.Match | None:
    """The first line of child `process` holding `pattern` (a regex) anywhere after its prefix."""
    return re.search(rf"^\[p{process}\] .*?{pattern}", out, re.M)
