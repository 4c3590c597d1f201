"""The environment of a script a test starts as a child process (scripts/train.py, a jax job).

The child imports this checkout's longctx (PYTHONPATH), prints as it goes (unbuffered, so a test
that reads its output while it runs sees each line), and inherits none of the LONGCTX_* settings
of the test's own process: each test sets those it means (`extra`).
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCTX_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
