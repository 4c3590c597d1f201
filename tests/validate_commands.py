"""Runs many script command lines, each in its own process, fast: tests/test_docs_commands.py's.

  python tests/validate_commands.py < commands.json > results.json

stdin: a JSON list of {"argv": [sys.executable, "scripts/x.py", ...], "env": {...}} (variables
set for that command only), run from the current directory. Each runs in a process forked from this one after the heavy modules (jax, flax, orbax,
grain, longctx) are imported, so a command costs its own work, not three seconds of imports: the
child sets sys.argv and sys.path as `python SCRIPT ARGS` would, runs the script as __main__ and
exits with its status. Nothing in this process has started a jax backend, so forking is safe.
stdout: a JSON list of {"returncode", "stdout", "stderr"}, one per command, in order.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import tempfile

# What the scripts import; each only speeds things up (a module that fails to import here is
# imported, and fails, in the command that needs it).
PRELOAD = ("jax", "numpy", "absl.app", "absl.flags", "ml_collections.config_flags", "longctx.cli",
           "longctx.config", "longctx.train.loop", "longctx.plan.aot", "longctx.interop.hf", "longctx.evals.inference",
           "longctx.evals.needle", "longctx.interop.params_io", "longctx.evals.ablation", "longctx.data.prepare")


def _child(argv: list[str], env: dict, out_fd: int, err_fd: int) -> None:
    """In the forked child: `python SCRIPT ARGS` from here on; never returns."""
    os.environ.update(env)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    status = 0
    try:
        script = argv[1]
        sys.argv = argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (what python would print for an uncaught exception)
        sys.excepthook(*sys.exc_info())
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run(argv: list[str], env: dict) -> dict:
    if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
        raise ValueError(f"not a `{sys.executable} SCRIPT.py ...` command: {argv}")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(argv, env, out.fileno(), err.fileno())
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def run_scripts(commands: list[list[str]], cwd: str | None = None, env: dict | None = None) -> list[dict]:
    """For a test: [{"returncode", "stdout", "stderr"}] of each `python SCRIPT ARGS` in `commands`
    ([SCRIPT, ARGS...], run from `cwd`, default the checkout), through this file in one child
    process (one import of jax for them all). LONGCTX_VALIDATE_ONLY and LONGCTX_DEBUG are not
    passed on: a command is validate-only when it says --validate_only."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("LONGCTX_VALIDATE_ONLY", "LONGCTX_DEBUG")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          input=json.dumps([{"argv": [sys.executable, *c]} for c in commands]),
                          capture_output=True, text=True, cwd=cwd or root, env={**env, "PYTHONPATH": root},
                          timeout=900)
    if done.returncode:
        raise RuntimeError(f"{__file__} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    commands = json.load(sys.stdin)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (see PRELOAD)
            pass
    from jax._src import xla_bridge

    assert not xla_bridge.backends_are_initialized(), "a preloaded module started jax: cannot fork"
    json.dump([run(c["argv"], c.get("env", {})) for c in commands], sys.stdout)


if __name__ == "__main__":
    main()
