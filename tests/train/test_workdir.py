"""longctx.train.workdir.check_writable: a probe per process (pods run Python as PID 1), and a file in
the way named as a file; check_named: an empty --workdir is refused."""

import os
import re
import sys

import pytest

from longctx.errors import ConfigError
from longctx.train import workdir
from tests import ROOT
from tests.validate_commands import ScriptServer


def test_probe_names_are_unique_per_process_even_with_one_pid(monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)  # every GKE pod runs Python as PID 1
    names = {workdir.probe_name() for _ in range(50)}
    assert len(names) == 50
    for name in names:  # jax process index (this test process is process 0) + a random token
        assert re.fullmatch(r"\.write_probe-p0-[0-9a-f]{16}", name), name


def test_two_hosts_probing_one_directory_at_once_both_pass(tmp_path, monkeypatch):
    """Host A writes its probe; before A deletes it, host B (same PID, same process index: two
    jobs sharing a bucket) runs its whole probe in the same directory. With one probe name per
    PID, B deleted A's probe and A was told the healthy directory "is not writable"."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    path_type = type(workdir.resolve(str(tmp_path)))
    original = path_type.write_text
    host_b = {}

    def write_text(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.name.startswith(".write_probe") and "result" not in host_b:
            host_b["result"] = None
            host_b["result"] = workdir.check_writable(str(tmp_path))  # B, while A's probe exists
        return out

    monkeypatch.setattr(path_type, "write_text", write_text)
    assert workdir.check_writable(str(tmp_path)) is None  # host A
    assert host_b == {"result": None}
    assert os.listdir(tmp_path) == []  # both probes removed, nothing else touched


def test_a_file_where_the_workdir_should_be_is_named_as_a_file(tmp_path):
    blocker = tmp_path / "wfile"
    blocker.write_text("keep me")
    assert workdir.check_writable(str(blocker)) == f"{blocker} is a file, not a directory"
    assert workdir.check_writable(str(blocker / "run")) == f"{blocker} is a file, not a directory"
    assert blocker.read_text() == "keep me"
    assert workdir.check_writable(str(tmp_path / "new" / "run")) is None


def test_an_empty_directory_name_is_refused_not_taken_as_the_current_directory():
    for empty in ("", "  ", None):
        with pytest.raises(ConfigError, match=r"^--workdir is empty: name a directory, e\.g\. --workdir=runs/demo\.$"):
            workdir.check_named(empty)
    with pytest.raises(ConfigError, match=r"^--out is empty"):
        workdir.check_named("", "--out")
    workdir.check_named("runs/demo")


@pytest.mark.parametrize("script, flags", [
    ("ablate.py", ["--grid=configs/ablations/masks.py", "--dry-run"]),
    ("eval_needle.py", []),
])
def test_scripts_refuse_an_empty_workdir(tmp_path, script, flags):
    """`--workdir=` was the current directory: ablate.py put its variants' runs there, eval_needle.py
    read it as a run."""
    root = ROOT
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    flags = [f.replace("configs/", os.path.join(root, "configs") + "/") for f in flags]
    r = ScriptServer.run([sys.executable, os.path.join(root, "scripts", script), "--workdir=", *flags],
                         cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == "longctx: --workdir is empty: name a directory, e.g. --workdir=runs/demo."
    assert os.listdir(tmp_path) == []
