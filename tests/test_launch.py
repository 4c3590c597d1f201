"""launch/: the loopback launcher for real (processes, signals, one JAX job), and the TPU VM / GKE
launchers through their --dry-run output (they need gcloud / kubectl and a TPU to run)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests import child_output
from tests.validate_commands import ScriptServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = os.path.join(ROOT, "launch", "local.py")
TPU_VM = os.path.join(ROOT, "launch", "tpu_vm.sh")
GKE = os.path.join(ROOT, "launch", "gke_jobset.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(args, script=None, timeout=120, script_args=(), **kwargs):
    command = [sys.executable, LOCAL, *args]
    if script is not None:
        command += ["--", sys.executable, "-c", textwrap.dedent(script), *script_args]
    return subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def _wait_gone(pids, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _wait_files(paths, timeout=60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.05)
    return False


def _read_pid(path) -> int:
    with open(path) as f:
        return int(f.read())


# ----------------------------------------------------------------------------- local.py: one job


ONE_JOB = """
import json, os, sys

from longctx.parallel import devices
devices.configure_cpu_devices()

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs import base
from longctx.parallel import mesh as mesh_lib
from longctx.parallel import processes

mesh_lib.maybe_initialize_distributed(base.get_config("tiny").distributed)  # empty settings: env
pid = jax.process_index()
result = dict(process=pid, count=jax.process_count(), devices=jax.device_count(),
              local=jax.local_device_count())
gathered = processes.allgather(np.array([10 * pid + 1], np.int32))
result["allgather"] = [int(v) for v in np.ravel(gathered)]

# A psum over a mesh axis whose 8 devices live in both processes.
mesh = Mesh(np.asarray(jax.devices()), ("sp",))
x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("sp")),
                                 lambda idx: np.arange(1, 9, dtype=np.float32)[idx])
psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "sp"), mesh=mesh, in_specs=P("sp"),
                             out_specs=P()))(x).block_until_ready()  # on every local device, before exit
result["psum"] = float(np.asarray(psum.addressable_data(0)).ravel()[0])

# Results go to a file: gloo's C++ logging writes into this process's stdout from its own threads,
# in pieces, and can land inside a printed line (and a print writes its text and its newline
# separately). Only a done-marker goes to stdout, as one write.
path = os.path.join(sys.argv[1], f"result{pid}.json")
with open(path + ".tmp", "w") as f:
    json.dump(result, f)
os.replace(path + ".tmp", path)
sys.stdout.write(f"ONE_JOB_DONE process={pid}\\n")
"""


@pytest.mark.slow
def test_two_processes_form_one_jax_job(tmp_path):
    t0 = time.monotonic()
    # A writer like gloo's shares the children's stdout in every run: the test must not be spliced.
    r = _launch(["--num-processes", "2", "--devices-per-process", "4"], child_output.foreign_writer() + ONE_JOB,
                timeout=240, script_args=[str(tmp_path)])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    for i in range(2):
        with open(tmp_path / f"result{i}.json") as f:
            result = json.load(f)
        # allgather: 10 * pid + 1 from each process; psum: 1 + 2 + ... + 8 across both processes' devices
        assert result == dict(process=i, count=2, devices=8, local=4, allgather=[1, 11], psum=36.0), result
        # each child's stdout reaches ours under its prefix, whatever other writers put before the marker
        assert child_output.find(r.stdout, i, rf"ONE_JOB_DONE process={i}$"), out[-5000:]
    assert "[foreign] piece" in r.stdout  # the foreign writer did write into the same lines
    # every child line carries its prefix
    for line in r.stdout.splitlines():
        assert re.match(r"\[p[01]\] ", line), line
    print(f"2x4 loopback job: {time.monotonic() - t0:.1f}s")


def test_environment_and_prefixes():
    script = """
    import os, sys
    keys = ["LONGCTX_COORDINATOR", "LONGCTX_NUM_PROCESSES", "LONGCTX_PROCESS_ID", "LONGCTX_CPU_DEVICES",
            "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS"]
    for k in keys:
        print(f"{k}={os.environ.get(k)}")
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    """
    r = _launch(["-n", "3", "-d", "2"], script)
    assert r.returncode == 0, r.stderr
    coordinators = set(re.findall(r"LONGCTX_COORDINATOR=(\S+)", r.stdout))
    assert len(coordinators) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coordinators.pop())
    for i in range(3):
        assert f"[p{i}] LONGCTX_PROCESS_ID={i}" in r.stdout
        assert f"[p{i}] LONGCTX_NUM_PROCESSES=3" in r.stdout
        assert f"[p{i}] LONGCTX_CPU_DEVICES=2" in r.stdout
        assert f"[p{i}] JAX_NUM_CPU_DEVICES=2" in r.stdout
        assert f"[p{i}] JAX_PLATFORMS=cpu" in r.stdout
        assert f"[p{i}] to stderr" in r.stderr
        assert f"[p{i}] no newline at the end" in r.stdout


def test_given_port_is_used():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _launch(["-n", "1", "-d", "1", "--port", str(port)],
                "import os; print(os.environ['LONGCTX_COORDINATOR'])")
    assert r.returncode == 0, r.stderr
    assert f"[p0] 127.0.0.1:{port}" in r.stdout


@pytest.mark.parametrize("tail", [b"\n", b""], ids=["with_newline", "cut_at_exit"])
def test_gloo_connection_lines_are_dropped_also_when_the_child_exits_mid_line(tail):
    """The pump removes gloo's "[Gloo] Rank N is connected" lines, also one the child left without
    its newline when it exited (once under load: the line reached the user)."""
    import importlib.util
    import io
    import threading

    spec = importlib.util.spec_from_file_location("launch_local", LOCAL)
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    read, write = os.pipe()
    os.write(write, b"ours\n[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
             b"connected peer ranks is : 1" + tail)
    os.close(write)
    out = io.BytesIO()
    local._Pump(os.fdopen(read, "rb"), out, b"[p1] ", threading.Lock()).run()
    assert out.getvalue() == b"[p1] ours\n"


# ----------------------------------------------------------------------------- local.py: bad input


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "-d", "4"], "no command given"),
    (["-n", "2", "-d", "4", "--"], "no command given"),
    (["-n", "0", "-d", "4", "--", "true"], "--num-processes must be at least 1"),
    (["-n", "2", "-d", "0", "--", "true"], "--devices-per-process must be at least 1"),
    (["-n", "1000", "-d", "1", "--", "true"], "more than the 64 processes"),
    (["-n", "8", "-d", "512", "--", "true"], "more than the 256 virtual CPU devices"),
    (["-n", "16", "-d", "128", "--", "true"], "2048 devices, more than the 1024"),
    (["-n", "2", "-d", "4", "--", "/nonexistent/program"], "cannot start '/nonexistent/program'"),
])
def test_bad_input_is_one_sentence(args, message):
    t0 = time.monotonic()
    r = _launch(args, timeout=30)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("launch/local.py: ")]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 10


def test_port_in_use_is_one_sentence():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _launch(["-n", "2", "-d", "4", "--port", str(port), "--", "true"], timeout=30)
    assert r.returncode != 0
    assert r.stderr.strip() == (f"launch/local.py: coordinator port {port} is already in use on this "
                                "machine; choose another --port or omit --port to get a free one."), r.stderr


# ----------------------------------------------------------------------------- local.py: failures, signals


def test_failing_child_stops_the_others(tmp_path):
    # process 0 ignores SIGTERM (like a process stuck in a collective): the launcher must kill it.
    script = f"""
    import os, signal, sys, time
    pid = int(os.environ["LONGCTX_PROCESS_ID"])
    open(os.path.join({str(tmp_path)!r}, f"pid{{pid}}"), "w").write(str(os.getpid()))
    if pid == 1:
        time.sleep(0.5)
        print("failing now", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
    """
    t0 = time.monotonic()
    r = _launch(["-n", "2", "-d", "1", "--grace-period", "1"], script, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert elapsed < 15, elapsed
    assert "[p1] failing now" in r.stdout
    assert "process 1 exited with status 3; stopping the other 1 process(es)" in r.stderr
    pids = [_read_pid(tmp_path / f"pid{i}") for i in range(2)]
    assert _wait_gone(pids, 5) == [], "orphaned child processes"


def test_child_killed_by_signal_fails_the_job(tmp_path):
    script = """
    import os, signal, time
    if os.environ["LONGCTX_PROCESS_ID"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    """
    t0 = time.monotonic()
    r = _launch(["-n", "2", "-d", "1"], script, timeout=60)
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "process 0 was killed by SIGKILL" in r.stderr
    assert time.monotonic() - t0 < 15


def _start_sleepers(tmp_path, n, handler_body="", extra=()):
    """Launcher running n children that record their pid, install a SIGTERM handler, then sleep."""
    script = textwrap.dedent(f"""
    import os, signal, sys, time
    i = os.environ["LONGCTX_PROCESS_ID"]
    d = {str(tmp_path)!r}
    def on_term(signum, frame):
        open(os.path.join(d, f"term{{i}}"), "w").write(str(signum))
        {handler_body or "sys.exit(0)"}
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    open(os.path.join(d, f"pid{{i}}.tmp"), "w").write(str(os.getpid()))
    os.replace(os.path.join(d, f"pid{{i}}.tmp"), os.path.join(d, f"pid{{i}}"))
    print("ready", flush=True)
    for _ in range(1200):
        time.sleep(0.1)
    """)
    proc = subprocess.Popen([sys.executable, LOCAL, "-n", str(n), "-d", "1", *extra, "--", sys.executable, "-c",
                             script], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert _wait_files([tmp_path / f"pid{i}" for i in range(n)], 60), "children did not start"
    return proc, [_read_pid(tmp_path / f"pid{i}") for i in range(n)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_reaches_every_child(tmp_path, sig):
    proc, pids = _start_sleepers(tmp_path, 2)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # the children handled it and exited cleanly
    assert time.monotonic() - t0 < 10
    for i in range(2):
        assert (tmp_path / f"term{i}").read_text() == str(int(sig)), err
    assert f"got {signal.Signals(sig).name}; forwarding" in err
    assert _wait_gone(pids, 5) == []


def test_children_that_ignore_the_stop_are_killed_after_the_timeout(tmp_path):
    proc, pids = _start_sleepers(tmp_path, 2, handler_body="pass", extra=("--stop-timeout", "1"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "still running 1s after the stop signal; killing them" in err
    assert all((tmp_path / f"term{i}").exists() for i in range(2))
    assert _wait_gone(pids, 5) == []


def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc, pids = _start_sleepers(tmp_path, 2)
    proc.kill()  # SIGKILL: no handler runs; PR_SET_PDEATHSIG must take the children down
    proc.communicate(timeout=30)
    assert _wait_gone(pids, 10) == [], "children outlived a SIGKILLed launcher"


def test_grandchildren_are_cleaned_up(tmp_path):
    # A child that leaves a background grandchild in its process group: the group is killed.
    script = f"""
    import os, subprocess, sys
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(os.path.join({str(tmp_path)!r}, "grandchild" + os.environ["LONGCTX_PROCESS_ID"]), "w").write(str(p.pid))
    """
    r = _launch(["-n", "2", "-d", "1"], script, timeout=60)
    assert r.returncode == 0, r.stderr
    pids = [_read_pid(tmp_path / f"grandchild{i}") for i in range(2)]
    assert _wait_gone(pids, 10) == []


# ----------------------------------------------------------------------------- TPU VM script


TPU_ARGS = ["--name", "lc-pod", "--zone", "us-east5-a", "--project", "my-proj", "--accelerator-type", "v5p-128",
            "--runtime-version", "v2-alpha-tpuv5", "--config", "configs/base.py:llama3_8b_128k",
            "--workdir", "gs://my-bucket/runs/lc1"]


def _tpu_vm(*args, env=None):
    return subprocess.run(["bash", TPU_VM, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)


def test_tpu_vm_script_parses():
    r = subprocess.run(["bash", "-n", TPU_VM], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(TPU_VM) as f:
        assert "set -euo pipefail" in f.read()


def test_tpu_vm_dry_run_prints_the_commands():
    # No gcloud needed: the dry run must not call it (PATH without gcloud proves that).
    env = dict(os.environ, PATH="/usr/bin:/bin")
    r = _tpu_vm(*TPU_ARGS, "--dry-run", "--", "--config.train.num_steps=100", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    common = "--zone us-east5-a --project my-proj"
    assert f"gcloud compute tpus tpu-vm describe lc-pod {common}" in out
    assert (f"gcloud compute tpus tpu-vm create lc-pod {common} --accelerator-type v5p-128 "
            "--version v2-alpha-tpuv5") in out
    assert re.search(r"gcloud compute tpus tpu-vm scp \S+\.tar\.gz lc-pod:longctx\.tar\.gz "
                     + re.escape(common) + " --worker=all", out)
    assert f"gcloud compute tpus tpu-vm ssh lc-pod {common} --worker=all --command" in out
    assert "pip install" in out
    # the training command, the same on every worker, with the user's overrides
    assert ("python3 scripts/train.py --config=configs/base.py:llama3_8b_128k --workdir=gs://my-bucket/runs/lc1 "
            "--config.train.num_steps=100") in out
    # each worker learns its process id and the coordinator from the TPU metadata server
    assert "agent-worker-number" in out and "worker-network-endpoints" in out
    assert "LONGCTX_COORDINATOR" in out and "LONGCTX_PROCESS_ID" in out
    # logs: one per worker into the workdir, then copied back here
    assert "gs://my-bucket/runs/lc1/logs/" in out
    assert "gcloud storage cp" in out


def test_tpu_vm_reuse_and_spot_flags():
    r = _tpu_vm(*TPU_ARGS, "--spot", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "--spot" in r.stdout
    assert "reuse" in r.stdout.lower()


@pytest.mark.parametrize("args, message", [
    (["--zone", "z", "--workdir", "gs://b/r"], "--name is required"),
    (["--name", "n", "--workdir", "gs://b/r"], "--zone is required"),
    (["--name", "n", "--zone", "z"], "--workdir is required"),
    (["--name", "n", "--zone", "z", "--workdir", "/tmp/run"], "must be a gs:// path"),
    (["--name", "n", "--zone", "z", "--workdir", "gs://MY_BUCKET/runs/x"],  # launch/README.md's, before
     "--workdir gs://MY_BUCKET/runs/x: the bucket name MY_BUCKET must be lowercase letters, digits, "
     "'-', '_' and '.', starting and ending with a letter or digit (Cloud Storage's rule)"),
    (["--name", "n", "--zone", "z", "--workdir", "gs://my-bucket/runs/a b"],
     "--workdir gs://my-bucket/runs/a b: the path after gs://my-bucket may hold only letters, digits"),
    (["--name", "n", "--zone", "z", "--workdir", "gs://b/r", "--accelerator-type", "v5p"], "accelerator type"),
    (["--name", "n", "--zone", "z", "--workdir", "gs://b/r", "--bogus"], "unknown option --bogus"),
    (["--name"], "--name needs a value"),
])
def test_tpu_vm_bad_input(args, message):
    r = _tpu_vm(*args, "--dry-run")
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ----------------------------------------------------------------------------- GKE JobSet


GKE_ARGS = ["--name", "lc-ms", "--slices", "4", "--topology", "4x4x4", "--accelerator", "tpu-v5p-slice",
            "--image", "us-docker.pkg.dev/p/r/longctx:1", "--config", "configs/base.py:llama3_8b_128k",
            "--workdir", "gs://my-bucket/runs/ms1", "--dry-run"]


def _gke(*args):
    return ScriptServer.run([sys.executable, GKE, *args], cwd=ROOT, timeout=60)


def test_gke_jobset_manifest():
    r = _gke(*GKE_ARGS, "--", "--config.train.num_steps=500")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "kind: JobSet" in text and "apiVersion: jobset.x-k8s.io/v1alpha2" in text
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(text)
    assert doc["kind"] == "JobSet" and doc["metadata"]["name"] == "lc-ms"
    assert doc["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    (rjob,) = doc["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 4  # one Job per slice
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 16  # 4x4x4 = 64 chips / 4 per host
    assert job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["terminationGracePeriodSeconds"] >= 30  # time for the SIGTERM checkpoint
    (container,) = pod["containers"]
    assert container["image"] == "us-docker.pkg.dev/p/r/longctx:1"
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    command = container["command"]
    assert command[:2] == ["python3", "scripts/train.py"]
    assert "--config=configs/base.py:llama3_8b_128k" in command
    assert "--workdir=gs://my-bucket/runs/ms1" in command
    assert "--config.mesh.dcn_dp=4" in command  # the DCN axis spans the 4 slices
    assert command[-1] == "--config.train.num_steps=500"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LONGCTX_NUM_SLICES"] == "4"


def test_gke_dcn_axis_choice_and_single_slice():
    r = _gke(*GKE_ARGS[:3], "2", *GKE_ARGS[4:], "--dcn-axis", "fsdp", "--topology", "2x2x2")
    assert r.returncode == 0, r.stderr
    assert "--config.mesh.dcn_fsdp=2" in r.stdout and "dcn_dp" not in r.stdout
    assert "parallelism: 2" in r.stdout  # 2x2x2 = 8 chips = 2 hosts
    r = _gke(*GKE_ARGS[:3], "1", *GKE_ARGS[4:])
    assert r.returncode == 0, r.stderr
    assert "replicas: 1" in r.stdout and "--config.mesh.dcn_dp=1" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--slices", "0"], "--slices must be at least 1"),
    (["--topology", "4x4xq"], "--topology"),
    (["--topology", "3x3x3"], "not a multiple of the 4 chips per host"),
    (["--workdir", "/tmp/x"], "must be a gs:// path"),
    (["--name", "Bad_Name"], "--name"),
])
def test_gke_bad_input(args, message):
    argv = list(GKE_ARGS)
    for i in range(0, len(args), 2):
        k = argv.index(args[i])
        argv[k + 1] = args[i + 1]
    r = _gke(*argv)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
