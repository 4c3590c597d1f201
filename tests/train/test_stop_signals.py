"""SIGTERM and Ctrl-C outside the loop's steps: during start-up (nothing trained yet) they end the run
at once with one line, the lease released; in a run of several processes whose peer is gone, the
stop promises no save it cannot make and ends with one line saying nothing was saved.

The start-up case is a real process held in start-up (its restore waits) until the signal comes;
the peer case a real 2-process run (launch/local.py) whose process 1 is stopped, then killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from longctx.train import lease
from longctx.train import loop as train_loop
from tests import ROOT, child_env, child_output

SMALL_RUN = [  # the tiny preset, smaller (as tests/train/test_lease.py's)
    "--config=configs/base.py:tiny",
    "--config.model.d_model=64",
    "--config.model.mlp_dim=128",
    "--config.model.head_dim=16",
    "--config.data.seq_len=512",
    "--config.data.global_batch_size=2",
    "--config.attention.block_size=128",
    "--config.train.loss_chunk_size=128",
    "--config.train.eval_every=0",
    "--config.train.log_every=1",
]

# scripts/train.py's way to the run (cli.run), with the run held in start-up: its restore waits.
HELD_IN_START_UP = """
import sys, time
from longctx import cli
cli.start()
from absl import app, flags
from ml_collections import config_flags
from longctx.train import checkpoint, loop

def restore_or_init(self, *args, **kwargs):
    print("restoring", flush=True)
    time.sleep(300)  # (the signal's handler interrupts it)
    raise AssertionError("the signal did not stop the start-up")

checkpoint.Checkpointer.restore_or_init = restore_or_init
_CONFIG = config_flags.DEFINE_config_file("config", None, "")
_WORKDIR = flags.DEFINE_string("workdir", None, "")

def main(argv):
    loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)

cli.run_absl(main)
"""


@pytest.mark.parametrize("sig, name, status", [(signal.SIGTERM, "SIGTERM", 143), (signal.SIGINT, "Ctrl-C", 130)])
def test_a_signal_during_start_up_is_one_line_and_releases_the_lease(tmp_path, sig, name, status):
    """Not Python's silent status 143 with its lease left behind (for the next start to take over,
    with a note)."""
    workdir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", HELD_IN_START_UP, f"--workdir={workdir}", *SMALL_RUN],
                            cwd=ROOT, env=child_env.script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in proc.stdout:  # the run holds the lease and is restoring
            out.append(line)
            if line == "restoring\n":
                break
        assert out and out[-1] == "restoring\n", "".join(out)
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err
    assert err == (f"longctx: {name} during start-up: stopped before the first step; nothing was trained, so "
                   "nothing is lost (the same command starts the run).\n"), err
    assert "step 1" not in rest, rest
    directory = os.path.join(workdir, lease.LEASE_DIR)
    records = [json.load(open(os.path.join(directory, f))) for f in os.listdir(directory) if f.endswith(".json")]
    assert len(records) == 1 and records[0]["released"] is True, records


def test_a_signal_said_during_start_up_stops_the_run_even_if_its_handler_comes_late():
    """The watcher thread says a signal at once; Python's handler runs when the main thread is next
    in Python. A signal said during start-up whose handler has not run when the loop begins still
    ends the run there, as its line said, and is not taken for the loop's stop."""
    stop = train_loop._StopRequest(starting=True)
    try:
        stop._say(signal.SIGTERM)  # (as the watcher does, before the handler)
        with pytest.raises(SystemExit) as exit_:
            stop.training()
        assert exit_.value.code == 143 and not stop.requested
    finally:
        stop.restore()


def _child_pid(launcher: subprocess.Popen, process: int) -> int:
    """The pid of launch/local.py's child `process` (from its LONGCTX_PROCESS_ID)."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"\0LONGCTX_PROCESS_ID={process}\0".encode() in b"\0" + f.read():
                return int(pid)
    raise AssertionError(f"no child process {process} among {children}")


def test_with_several_processes_the_stop_promises_a_save_only_if_every_process_gets_there(monkeypatch, capfd):
    monkeypatch.setattr(train_loop.jax, "process_count", lambda: 2)
    stop = train_loop._StopRequest()
    try:
        stop._say(signal.SIGTERM)
    finally:
        stop.restore()
    assert capfd.readouterr().err == ("longctx: SIGTERM: stopping at the next log or checkpoint step (saved if "
                                      "every process gets there).\n")


@pytest.mark.slow
def test_a_run_whose_peer_died_promises_no_save(tmp_path):
    """A 2-process run whose process 1 is killed: the launcher sends SIGTERM to process 0, which
    said "it will be saved", then failed ("unexpected JaxRuntimeError: ... Gloo AllGather failed").
    Which comes first, the SIGTERM or the failed collective, is a race: either way each line is
    true: the stop promises a save only if every process gets there and then says none was made,
    or the error comes first and the SIGTERM after it promises nothing."""
    workdir = str(tmp_path / "run")
    launcher = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--num-processes", "2", "--devices-per-process",
         "4", "--grace-period", "20", "--", sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         f"--workdir={workdir}", *SMALL_RUN, "--config.checkpoint.every_steps=2", "--config.train.num_steps=100000"],
        cwd=ROOT, env=child_env.script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stdout:  # step 2 is saved
            if child_output.find(line, 0, "step 3: loss="):
                break
        os.kill(_child_pid(launcher, 1), signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert "process 1 was killed by SIGKILL; stopping the other 1 process(es)" in err, err
    said = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[p0] ")]
    assert "will be saved" not in err and not any(line.startswith("longctx: stopped at step") for line in said), err
    promise = "longctx: SIGTERM: stopping at the next log or checkpoint step (saved if every process gets there)."
    if said and said[0] == promise:
        # the SIGTERM first: then the failed collective (or, if it hangs, the launcher's kill)
        assert len(said) <= 2, err
        if len(said) == 2:
            ended = re.fullmatch(r"longctx: stopped without saving: another process of this run is gone or failed "
                                 r"\(a collective failed after the stop request: .+\); the newest checkpoint, step "
                                 r"(\d+), is where the next start resumes\.", said[1])
            assert ended and os.path.isdir(os.path.join(workdir, "checkpoints", ended.group(1))), err
    else:  # the failed collective first: the SIGTERM after it promises nothing (and may be said
        # before the error's own line, which comes when the process exits)
        errors_said = [line for line in said if line.startswith("longctx: unexpected ")]
        assert len(errors_said) == 1, err
        assert sorted(set(said) - set(errors_said)) in (
            [], ["longctx: SIGTERM: the run is already ending, on an error (said when it exits)."]), err
