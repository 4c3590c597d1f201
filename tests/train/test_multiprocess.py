"""One training run, two process counts: 2 processes x 4 CPU devices (launch/local.py, gloo over
loopback) against 1 process x 8 devices, with the sp ring spanning both processes; then the
2-process run is stopped with SIGTERM (to the launcher, as a preemption would) and resumed from
its checkpoint, and the resumed steps still match the uninterrupted run.

Both runs use the same global mesh (dp=1, fsdp=1, sp=8): devices 0-3 live in process 0 and 4-7
in process 1, so every ring step passes K/V between the processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import ROOT, child_env, child_output

LOCAL = os.path.join(ROOT, "launch", "local.py")
TRAIN = os.path.join(ROOT, "scripts", "train.py")

NUM_STEPS = 7
STOP_AFTER = 3  # SIGTERM once this step's metrics are written
# float32 end to end; the two runs differ only in how the cross-device reductions are ordered.
LOSS_RTOL = 1e-5

OVERRIDES = [
    "--config=configs/base.py:tiny",
    f"--config.train.num_steps={NUM_STEPS}",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.checkpoint.every_steps=0",  # only the forced saves: on the stop and at the end
    "--config.data.seq_len=512",
    "--config.data.global_batch_size=2",
    "--config.mesh.dp=1",
    "--config.mesh.fsdp=1",
    "--config.mesh.sp=8",
    "--config.attention.block_size=64",
    "--config.train.loss_chunk_size=64",
]


_env = child_env.script_env


def _losses(workdir, key: str = "train/loss") -> dict[int, float]:
    out = {}
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            if key in row:
                out[int(row["step"])] = float(row[key])
    return out


def _tail(text: str, n: int = 60) -> str:
    text = text.replace("[foreign] piece ", "")
    lines = [l for l in text.splitlines() if "[Gloo]" not in l and not re.match(r"(\[p\d\] )?I\d{4} ", l)]
    return "\n".join(lines[-n:])


# scripts/train.py behind a writer like gloo's into the same stdout (tests/child_output.py): the
# log lines this test reads must be found however other writers split them.
TRAIN_WITH_FOREIGN_WRITER = child_output.foreign_writer(0.01) + """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _two_process_command(workdir) -> list[str]:
    return [sys.executable, LOCAL, "--num-processes", "2", "--devices-per-process", "4", "--",
            sys.executable, "-c", TRAIN_WITH_FOREIGN_WRITER, TRAIN, f"--workdir={workdir}", *OVERRIDES]


@pytest.mark.slow
def test_two_processes_match_one_and_resume(tmp_path):
    t0 = time.monotonic()
    one, two = tmp_path / "one_process", tmp_path / "two_processes"

    # 1 process x 8 devices, uninterrupted, alongside the first 2-process run (which is stopped by
    # SIGTERM to the launcher after step STOP_AFTER).
    reference_run = subprocess.Popen([sys.executable, TRAIN, f"--workdir={one}", *OVERRIDES], cwd=ROOT,
                                     env=_env(LONGCTX_CPU_DEVICES="8"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
    launcher = subprocess.Popen(_two_process_command(two), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while STOP_AFTER not in _losses(two) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.poll() is None, "the 2-process run ended before it could be stopped:\n" + _tail(
            launcher.communicate()[0])
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=300)
        reference_out, _ = reference_run.communicate(timeout=600)
    finally:
        for proc in (launcher, reference_run):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert reference_run.returncode == 0, _tail(reference_out)
    reference = _losses(one)
    assert sorted(reference) == list(range(1, NUM_STEPS + 1)), reference

    assert launcher.returncode == 0, _tail(out)
    assert "got SIGTERM; forwarding SIGTERM to all processes" in out, _tail(out)
    assert child_output.find(out, 0, re.escape("longctx: 2 process(es), 8 cpu devices")), _tail(out)
    assert out.count("longctx: 2 process(es)") == 1, _tail(out)  # once, not once per process
    stopped = child_output.find(out, 0, r"longctx: stopped at step (\d+) \(saved")
    assert stopped, _tail(out)
    stop_step = int(stopped.group(1))
    assert STOP_AFTER <= stop_step < NUM_STEPS, (stop_step, _tail(out))
    assert not child_output.find(out, 1, "longctx:")  # logs are written once, by process 0
    before = _losses(two)
    assert max(before) == stop_step, (before, stop_step)
    t_first = time.monotonic() - t0

    # Resume the 2-process run from its checkpoint and finish.
    r = subprocess.run(_two_process_command(two), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, _tail(out)
    assert child_output.find(out, 0, rf"longctx: resumed from \S+ \(step {stop_step}\)"), _tail(out)
    assert out.count("longctx: resumed from") == out.count("longctx: 2 process(es)") == 1, _tail(out)
    after = _losses(two)
    assert max(after) == NUM_STEPS, after
    t_resume = time.monotonic() - t0 - t_first

    # The same losses, step for step, before and after the resume.
    common = sorted(set(reference) & set(after))
    assert common == list(range(1, NUM_STEPS + 1)), common
    assert [s for s in common if s > stop_step], "no step after the resume to compare"
    np.testing.assert_allclose([after[s] for s in common], [reference[s] for s in common], rtol=LOSS_RTOL,
                               err_msg=f"steps {common}; stopped at {stop_step}")
    # MFU's attention pairs: the processes of the one sp group feed the same rows, counted once.
    # (a resumed run's first step is untimed: no MFU, no pairs)
    pairs, pairs_two = _losses(one, "train/attention_pairs"), _losses(two, "train/attention_pairs")
    assert len(set(pairs) & set(pairs_two)) >= NUM_STEPS - 2, (pairs, pairs_two)
    assert all(pairs[s] == pairs_two[s] for s in set(pairs) & set(pairs_two)), (pairs, pairs_two)
    print("\nstep  1x8 loss    2x4 loss (stop at %d, resume)" % stop_step)
    for s in common:
        print(f"{s:4d}  {reference[s]:.6f}  {after[s]:.6f}")
    print(f"times: 1x8 alongside 2x4 until stopped {t_first:.0f}s, 2x4 resumed {t_resume:.0f}s")
