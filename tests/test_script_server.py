"""tests/validate_commands.ScriptServer answers as subprocess.run does, for the commands tests run
through it: output, exit status, uncaught errors, the environment and directory given, what runs
at exit, and the timeout."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.validate_commands import ScriptServer

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    atexit.register(lambda: print("at exit", flush=True))
    print("cwd", os.path.basename(os.getcwd()), "var", os.environ.get("SERVER_TEST_VAR"))
    print("argv", sys.argv[1:], "path0", os.path.basename(sys.path[0]))
    print("to stderr", file=sys.stderr)
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("boom")
    if what == "sleep":
        import time
        time.sleep(30)
    sys.exit({"ok": 0, "three": 3, "message": "a message"}[what])
""")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "script.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("what", ["ok", "three", "message", "raise"])
def test_the_server_answers_as_subprocess_run(script, what, tmp_path):
    env = dict(os.environ, SERVER_TEST_VAR=what)
    argv = [sys.executable, str(script), what]
    want = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    got = ScriptServer.run(argv, cwd=tmp_path, env=env, timeout=60)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
    assert got.stderr.replace(str(script), "S") == want.stderr.replace(str(script), "S")
    assert f"var {what}" in got.stdout and "at exit" in got.stdout


def test_a_variable_is_the_commands_own(script, tmp_path):
    """The environment is the one given, not what an earlier command of the same server had."""
    argv = [sys.executable, str(script), "ok"]
    ScriptServer.run(argv, cwd=tmp_path, env=dict(os.environ, SERVER_TEST_VAR="first"))
    env = {k: v for k, v in os.environ.items() if k != "SERVER_TEST_VAR"}
    assert "var None" in ScriptServer.run(argv, cwd=tmp_path, env=env).stdout


def test_a_command_past_its_timeout_is_killed(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        ScriptServer.run([sys.executable, str(script), "sleep"], cwd=tmp_path, timeout=2)
    assert ScriptServer.run([sys.executable, str(script), "ok"], cwd=tmp_path).returncode == 0
