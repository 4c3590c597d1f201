"""Runs script command lines, each in its own process, fast: for tests/test_docs_commands.py and
every test that runs `python SCRIPT.py ARGS` and reads its output (`ScriptServer`).

  python tests/validate_commands.py < commands.json > results.json
  python tests/validate_commands.py --serve      # one command per line, one result per line

stdin: a JSON list of {"argv": [sys.executable, "scripts/x.py", ...], "env": {...}} (variables
set for that command only), run from the current directory. Each runs in a process forked from
this one after the heavy modules (jax, flax, orbax, grain, longctx) are imported, so a command
costs its own work, not three seconds of imports: the child sets sys.argv and sys.path as
`python SCRIPT ARGS` would, runs the script as __main__ and exits with its status, after what a
Python process runs at exit. Nothing in this process has started a jax backend, so forking is safe.
stdout: a JSON list of {"returncode", "stdout", "stderr", "timed_out"}, one per command, in order.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time

# What the scripts import; each only speeds things up (a module that fails to import here is
# imported, and fails, in the command that needs it).
PRELOAD = ("jax", "numpy", "absl.app", "absl.flags", "ml_collections.config_flags", "longctx.cli",
           "longctx.config", "longctx.train.loop", "longctx.plan.aot", "longctx.interop.hf", "longctx.evals.inference",
           "longctx.evals.needle", "longctx.interop.params_io", "longctx.evals.ablation", "longctx.data.prepare")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A test's own settings, not passed on to what it starts: a command says --validate_only itself.
_TEST_ONLY = ("LONGCTX_VALIDATE_ONLY", "LONGCTX_DEBUG")


def _child(argv: list[str], env: dict, out_fd: int, err_fd: int, replace_env=False) -> None:
    """In the forked child: `python SCRIPT ARGS` from here on; never returns."""
    if replace_env:
        os.environ.clear()
    os.environ.update(env)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
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
    except BaseException as e:  # noqa: BLE001  (what python would print for an uncaught exception)
        tb = e.__traceback__  # from the script's own frame on, as python shows it
        while tb is not None and tb.tb_frame.f_code.co_filename != argv[1]:
            tb = tb.tb_next
        e = e.with_traceback(tb or e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    finally:
        try:  # what the interpreter does at exit: join the threads left, then the atexit calls
            threading._shutdown()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def run(argv: list[str], env: dict, cwd: str | None = None, timeout: float | None = None,
        replace_env: bool = False) -> dict:
    """{"returncode", "stdout", "stderr", "timed_out"} of `python SCRIPT ARGS` in a forked child:
    `env` set for it (its whole environment with `replace_env`), from `cwd`, killed after
    `timeout` seconds."""
    if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
        raise ValueError(f"not a `{sys.executable} SCRIPT.py ...` command: {argv}")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            if cwd is not None:
                os.chdir(cwd)
            _child(argv, env, out.fileno(), err.fileno(), replace_env=replace_env)
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        while True:
            done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace"), "timed_out": timed_out}


def _serve(reply) -> None:
    """--serve: each stdin line {"argv", "env", "cwd", "timeout"} runs as `run` runs it (the
    command's whole environment is `env`); each line to `reply` (the server's stdout) is its
    result."""
    for line in sys.stdin:
        c = json.loads(line)
        reply.write(json.dumps(run(c["argv"], c["env"], c["cwd"], c["timeout"], replace_env=True))
                    + "\n")
        reply.flush()


# Read when python or jax starts (jax's flags take their defaults from the environment at import):
# commands that set them alike share a server started with them.
_READ_AT_IMPORT = ("JAX_", "PYTHON", "XLA_PYTHON")


class ScriptServer:
    """subprocess.run(argv, capture_output=True, text=True, cwd=, env=, timeout=, check=) for a
    `python SCRIPT.py ARGS` command, in a child forked from a server that imported the heavy
    modules once (`--serve`): about three CPU seconds less a command. A test process starts a server at its
    first command, one for each setting of what python and jax read at start-up
    (_READ_AT_IMPORT), with that command's environment. A command that is not `python SCRIPT.py`
    runs as subprocess.run would run it. What the heavy modules print as they import goes to the
    server's log, not to the command's stderr: a test of that output starts a process of its own."""

    _servers: dict = {}  # import-time settings -> (server, its stderr)

    @classmethod
    def run(cls, argv, *, cwd=None, env=None, timeout=None,
            check=False) -> subprocess.CompletedProcess:
        argv = [str(a) for a in argv]
        env = dict(os.environ if env is None else env)
        cwd = os.path.abspath(cwd or os.getcwd())
        if not (len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")):
            return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=check)
        key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_IMPORT)))
        server, log = cls._start(key, env)
        server.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": cwd,
                                       "timeout": timeout}) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        if not line:
            del cls._servers[key]
            log.seek(0)
            raise RuntimeError(f"{__file__} --serve stopped: {log.read()[-3000:].decode()}")
        r = json.loads(line)
        if r["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout, r["stdout"], r["stderr"])
        done = subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])
        if check:
            done.check_returncode()
        return done

    @classmethod
    def _start(cls, key, env):
        if key not in cls._servers or cls._servers[key][0].poll() is not None:
            log = tempfile.TemporaryFile()
            server = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                env={k: v for k, v in env.items()
                     if k not in _TEST_ONLY})
            atexit.register(_stop, server)
            cls._servers[key] = (server, log)
        return cls._servers[key]


def _stop(server: subprocess.Popen) -> None:
    """At the test process's exit: the server's input closed ends it (killed if it does not)."""
    server.stdin.close()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run_scripts(commands: list[list[str]], cwd: str | None = None, env: dict | None = None) -> list[dict]:
    """For a test: `run`'s result of each `python SCRIPT ARGS` in `commands`
    ([SCRIPT, ARGS...], run from `cwd`, default the checkout), through this file in one child
    process (one import of jax for them all). LONGCTX_VALIDATE_ONLY and LONGCTX_DEBUG are not
    passed on: a command is validate-only when it says --validate_only."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in _TEST_ONLY}
    done = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          input=json.dumps([{"argv": [sys.executable, *c]} for c in commands]),
                          capture_output=True, text=True, cwd=cwd or ROOT, env={**env, "PYTHONPATH": ROOT},
                          timeout=900)
    if done.returncode:
        raise RuntimeError(f"{__file__} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    serve = sys.argv[1:] == ["--serve"]
    commands = None if serve else json.load(sys.stdin)
    if serve:  # the replies keep stdout; anything else printed goes to stderr
        reply = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (see PRELOAD)
            pass
    from jax._src import xla_bridge

    assert not xla_bridge.backends_are_initialized(), "a preloaded module started jax: cannot fork"
    if serve:
        _serve(reply)
        return
    json.dump([run(c["argv"], c.get("env", {})) for c in commands], sys.stdout)


if __name__ == "__main__":
    main()
