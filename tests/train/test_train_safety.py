"""The training loop keeps what it saves and writes sound: no checkpoint holds a non-finite state,
a failed save is one sentence naming the step and the newest complete one, a resume's metrics read
as one run, and files and traces are closed when the loop leaves early.

Runs are real (`train_and_evaluate` on the embedded corpus, 8 CPU devices) and small; a divergence
is injected by wrapping the jitted train step so that one step returns NaN parameters and loss.
"""

import errno
import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid

import jax
import jax.numpy as jnp
import pytest

from configs import base
from longctx import errors
from longctx.parallel import mesh as mesh_lib
from longctx.train import checkpoint as checkpoint_lib
from longctx.train import hooks
from longctx.train import lease as lease_lib
from longctx.train import loop as train_loop
from longctx.train import optimizer as train_optimizer
from longctx.train import state as train_state
from longctx.train import steps as train_steps
from tests import ROOT
from tests.validate_commands import ScriptServer

TRAIN = os.path.join(ROOT, "scripts", "train.py")


def _config(num_steps: int, *, every_steps: int, log_every: int):
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(d_model=64, mlp_dim=128, head_dim=16)
    c.data.update(seq_len=512, global_batch_size=2)
    c.attention.block_size = 128
    c.train.update(num_steps=num_steps, log_every=log_every, eval_every=0, loss_chunk_size=128)
    c.checkpoint.update(every_steps=every_steps, max_to_keep=5)
    return c


def _diverge_at(monkeypatch, bad_step: int):
    """From call `bad_step` on, the train step's parameters and loss become NaN (a divergence)."""
    real = train_steps.jit_steps

    def jit_steps(config, setup):
        train_step, eval_step = real(config, setup)
        calls = itertools.count(1)

        def step(state, batch):
            state, metrics = train_step(state, batch)
            if next(calls) >= bad_step:
                state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
                metrics = dict(metrics, loss=metrics["loss"] * jnp.nan)
            return state, metrics

        step.lower = train_step.lower  # (the loop compiles the jitted step ahead of the first)
        return step, eval_step

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)


def _steps(workdir) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _logged_steps(workdir) -> list[int]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def test_nonfinite_between_a_save_and_a_log_step_is_never_saved(tmp_path, monkeypatch):
    """Saves at 4 and 8, logs at 1 and 10: the NaN of step 6 must not be saved at 8."""
    workdir = str(tmp_path / "run")
    _diverge_at(monkeypatch, bad_step=6)
    with pytest.raises(errors.RunError) as error:
        train_loop.train_and_evaluate(_config(12, every_steps=4, log_every=10), workdir)
    assert str(error.value).startswith(
        "non-finite loss or gradient at step 6 (loss nan, grad norm ")
    assert "the newest checkpoint, step 4, holds only finite steps" in str(error.value)
    assert _steps(workdir) == [4]


def test_resume_drops_metrics_rows_past_the_restored_step(tmp_path, monkeypatch):
    """Steps 5 and 6 are logged, then the run stops with 4 saved: the resumed run logs 5 and 6
    again, and metrics.jsonl holds each step once, in order."""
    workdir = str(tmp_path / "run")
    with monkeypatch.context() as patch:
        _diverge_at(patch, bad_step=7)
        with pytest.raises(errors.RunError, match="at step 7"):
            train_loop.train_and_evaluate(_config(8, every_steps=4, log_every=1), workdir)
    assert _steps(workdir) == [4] and _logged_steps(workdir) == [1, 2, 3, 4, 5, 6]
    train_loop.train_and_evaluate(_config(8, every_steps=4, log_every=1), workdir)
    assert _logged_steps(workdir) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _steps(workdir) == [4, 8]


def test_a_loop_that_leaves_early_stops_its_profile_trace(tmp_path, monkeypatch):
    workdir = str(tmp_path / "run")
    config = _config(6, every_steps=0, log_every=1)
    config.train.update(profile_start=1, profile_steps=4)  # the trace would stop after step 5
    _diverge_at(monkeypatch, bad_step=3)
    with pytest.raises(errors.RunError, match="at step 3"):
        train_loop.train_and_evaluate(config, workdir)
    traces = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
    assert any(f.endswith(".xplane.pb") for f in traces), traces  # written when a trace stops
    jax.profiler.start_trace(str(tmp_path / "again"))  # raises if the first trace still ran
    jax.profiler.stop_trace()


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MiB tmpfs: one checkpoint of the small model (1.5 MiB) fits, a second does not. A
    real full disk, so the error takes Orbax's own path (a background write that fails). Skipped
    where mounting is not allowed (it needs root, which CI has)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_during_a_save_is_one_line_and_the_next_start_resumes(small_disk, capsys):
    """The real script on a disk that fills at the second save: one line on stderr naming the
    step being saved and the newest complete one, exit 1, step 2 intact; with space again, the
    next start resumes from step 2."""
    workdir = str(small_disk / "run")
    config = _config(6, every_steps=2, log_every=1)
    env = {k: v for k, v in os.environ.items() if k not in ("LONGCTX_DEBUG", "XLA_FLAGS")}
    proc = ScriptServer.run([sys.executable, TRAIN, f"--workdir={workdir}", *_overrides(config)],
                            timeout=300, env=env, cwd=ROOT)
    # stderr holds tqdm's progress bar (carriage-return updates) and the one line, nothing else
    # (by timing, dozens of "Event loop is closed" tracebacks could come with it).
    lines = [line.split("\r")[-1] for line in proc.stderr.splitlines()]
    lines = [line for line in lines if line.strip() and not line.startswith("train:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines == [
        f"longctx: could not save checkpoint step 4 to {workdir}/checkpoints (No space left on "
        "device (errno 28)); the newest complete checkpoint is step 2, where the next start "
        "resumes. Free space there (or point the run at another workdir) and start it again."], lines
    assert _steps(workdir) == [2]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    capsys.readouterr()
    train_loop.train_and_evaluate(config, workdir)
    assert f"longctx: resumed from {workdir}/checkpoints/2 (step 2)" in capsys.readouterr().out
    assert _steps(workdir) == [2, 4, 6]


METRICS_ON_A_FULL_DISK = """
import sys
from longctx import errors
from longctx.train import metrics
disk = sys.argv[1]
writer = metrics.MetricsWriter(disk + "/run", enabled=True)
try:
    with open(disk + "/filler", "wb") as f:
        f.write(bytes(8 << 20))
except OSError:
    pass  # the disk is full
try:
    for step in range(1, 100_000):
        writer.write(step, {"loss": 1.0, "grad_norm": 2.0})
except errors.RunError as e:
    print(e)
writer.close()  # raises nothing: the failed write was the error
"""


def test_metrics_on_a_full_disk_are_one_sentence_and_nothing_at_exit(small_disk):
    """A disk that fills under metrics.jsonl and the TensorBoard file: a RunError naming the file,
    and closing and exiting print nothing (tensorboardX's SummaryWriter printed tracebacks from its
    writer thread and its exit hook)."""
    proc = subprocess.run([sys.executable, "-c", METRICS_ON_A_FULL_DISK, str(small_disk)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.startswith(f"could not write metrics to {small_disk}/run/"), proc.stdout
    assert "(No space left on device (errno 28)). Free space there" in proc.stdout, proc.stdout


ABANDONED_IO = """
import asyncio, gc, tempfile, threading
import jax, numpy as np
import tensorstore as ts
from orbax.checkpoint._src.serialization import limits, serialization
from configs import base
from longctx.train import checkpoint
checkpoint.Checkpointer(tempfile.mkdtemp(), base.get_config("tiny"))

# A TensorStore write in flight when its save's loop is closed (as Orbax closes a failed save's):
# its completion callback fails on the closed loop, reported through sys.unraisablehook.
promise, write = ts.Promise.new()
async def save():
    await write
loop = asyncio.new_event_loop()
task = loop.create_task(save())
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
writer = threading.Thread(target=promise.set_result, args=(None,))
writer.start()
writer.join()  # (so that the reports below do not interleave)

# Orbax's own read of one array, still pending when its restore is given up (as when another
# array of the checkpoint is corrupt): collected, it fails on the GeneratorExit that closes it.
async def read_that_never_ends(**_):
    await asyncio.get_running_loop().create_future()
serialization._read_shard = read_that_never_ends
async def restore():
    read = serialization._read_array_index_and_device_put(
        jax.devices()[:1], (slice(0, 4, 1),), ts.array(np.zeros(4, np.float32)), global_shape=(4,),
        new_shard_shape=(4,), dtype=None, byte_limiter=limits.get_byte_limiter(None), strict=True,
        dll=None, memory_kind=None)
    pending = asyncio.ensure_future(read)
    await asyncio.sleep(0.01)
    return pending
loop = asyncio.new_event_loop()
pending = loop.run_until_complete(restore())
assert not pending.done()
del pending
loop.close()
gc.collect()

class Unrelated:  # any other unraisable error is still reported
    def __del__(self):
        raise ValueError("an unrelated error in __del__")
Unrelated()  # (deleted at once: its __del__ raises)
"""


def test_reports_of_abandoned_writes_and_reads_are_dropped_and_nothing_else():
    """The rule on its own, deterministically (the disk-full run and a resume past a corrupt
    checkpoint meet it only by timing): the closed-loop callback error of a write and the error of
    an Orbax read closed unfinished are dropped, an unrelated unraisable error is not;
    LONGCTX_DEBUG=1 keeps all three."""
    env = {k: v for k, v in os.environ.items() if k != "LONGCTX_DEBUG"}
    quiet = subprocess.run([sys.executable, "-c", ABANDONED_IO], capture_output=True, text=True,
                           timeout=120, env=env, cwd=ROOT)
    debug = subprocess.run([sys.executable, "-c", ABANDONED_IO], capture_output=True, text=True,
                           timeout=120, env=dict(env, LONGCTX_DEBUG="1"), cwd=ROOT)
    assert quiet.returncode == 0 and debug.returncode == 0, quiet.stderr + debug.stderr
    assert "ValueError: an unrelated error in __del__" in quiet.stderr, quiet.stderr
    assert "Event loop is closed" not in quiet.stderr, quiet.stderr
    assert "Encountered error while reading array index" not in quiet.stderr, quiet.stderr
    assert "ValueError: an unrelated error in __del__" in debug.stderr, debug.stderr
    assert "RuntimeError: Event loop is closed" in debug.stderr, debug.stderr
    assert ("Exception ignored in: <coroutine object _read_array_index_and_device_put"
            in debug.stderr), debug.stderr


def _overrides(config) -> list[str]:
    """`--config.section.key=value` for every key `_config` sets on top of the tiny preset."""
    tiny = base.get_config("tiny").to_dict()
    return [f"--config={os.path.join(ROOT, 'configs', 'base.py')}:tiny"] + [
        f"--config.{section}.{key}={value}" for section, values in config.to_dict().items()
        if isinstance(values, dict) for key, value in values.items() if tiny[section][key] != value]


def test_a_data_error_while_resuming_leaves_the_checkpoint_alone(tmp_path):
    """A corrupt shard found while the data iterator is rebuilt for a resume is the data's fault:
    the error reaches the user and the (good) checkpoint is neither set aside nor skipped."""
    workdir = str(tmp_path / "run")
    config = _config(2, every_steps=2, log_every=1)
    train_loop.train_and_evaluate(config, workdir)
    mesh = mesh_lib.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, train_state.resolve_layout(config, mesh.shape["sp"]))

        def corrupt_data(seed_offset=0):
            raise errors.ConfigError("data/train-00000.array_record is corrupt")

        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        with pytest.raises(errors.ConfigError, match="is corrupt"):
            checkpointer.restore_or_init(setup, corrupt_data)
        checkpointer.close()
    assert _steps(workdir) == [2]
    assert not os.path.exists(os.path.join(workdir, "checkpoints_unreadable"))


def test_a_vocabulary_larger_than_the_model_fails_before_anything_runs(tmp_path):
    config = _config(2, every_steps=2, log_every=1)
    config.model.vocab_size = 100  # the embedded corpus is byte-level: 256 + specials
    with pytest.raises(errors.ConfigError, match=r"model.vocab_size=100 is smaller than the "
                                                 r"dataset's tokenizer vocabulary \(\d+ in "):
        train_loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.fixture
def train_iterators(monkeypatch):
    """Every training iterator the run makes, each with `closed` set when it is closed."""
    from longctx import data as data_lib

    made, real = [], data_lib.make_batch_iterator

    def make(config, mesh, *, split="train", **kwargs):
        iterator = real(config, mesh, split=split, **kwargs)
        if split == "train":
            close, iterator.closed = iterator.close, False

            def closing():
                iterator.closed = True
                close()

            iterator.close = closing
            made.append(iterator)
        return iterator

    monkeypatch.setattr(data_lib, "make_batch_iterator", make)
    return made


def _poison_from(monkeypatch, bad_step: int):
    """From call `bad_step` on, the batch's targets are out of the vocabulary: the loss is NaN and,
    with on_nonfinite=skip, the step is skipped (parameters stay finite, unlike `_diverge_at`)."""
    real = train_steps.jit_steps

    def jit_steps(config, setup):
        train_step, eval_step = real(config, setup)
        calls = itertools.count(1)

        def step(state, batch):
            if next(calls) >= bad_step:
                batch = dict(batch, targets=batch["targets"] + 100_000)
            return train_step(state, batch)

        step.lower = train_step.lower  # (the loop compiles the jitted step ahead of the first)
        return step, eval_step

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)


def test_a_skip_run_stops_after_max_consecutive_skips(tmp_path, monkeypatch, train_iterators):
    """Every step non-finite with on_nonfinite=skip: before train.max_consecutive_skips, the run
    skipped all 12, saved, and ended "finished" with exit 0. Now it stops with stop's one line at
    the third in a row, before saving it; and its training iterator is closed on that error too."""
    workdir = str(tmp_path / "run")
    config = _config(12, every_steps=2, log_every=1)
    config.train.update(on_nonfinite="skip", max_consecutive_skips=3)
    _poison_from(monkeypatch, bad_step=1)
    with pytest.raises(errors.RunError) as error:
        train_loop.train_and_evaluate(config, workdir)
    assert str(error.value).startswith("non-finite loss or gradient at step 3 (loss nan, grad norm ")
    assert str(error.value).endswith(
        "), the last of 3 steps in a row skipped for it (train.max_consecutive_skips=3); stopped before "
        "saving it, and the newest checkpoint, step 2, holds only finite steps. Skipping does not get "
        "this run past them: check the data and the learning rate (or raise "
        "train.max_consecutive_skips)."), str(error.value)
    assert _steps(workdir) == [2]
    assert train_iterators and all(it.closed for it in train_iterators)


def test_start_up_lines_and_a_finished_run_started_again(tmp_path, monkeypatch, capsys, train_iterators):
    """A warmup longer than the run and a resume that raises train.num_steps are each one line at
    start-up; a finished run started again says there is nothing to do, compiling nothing. Every
    training iterator is closed when its run ends, also when it ends in an error."""
    workdir = str(tmp_path / "run")
    config = _config(2, every_steps=2, log_every=1)  # the tiny preset's warmup: 10 steps
    train_loop.train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert ("longctx: optimizer.warmup_steps=10 is more than train.num_steps=2: the warmup is cut to 2 "
            "steps, so the learning rate rises until the last step") in out, out
    assert "longctx: finished; last logged train loss" in out, out

    class Compiled(Exception):
        pass

    def no_compile(*_):
        raise Compiled

    monkeypatch.setattr(train_loop, "jit_steps", no_compile)  # (the lines come before: no need to train)
    config.train.num_steps = 4
    with pytest.raises(Compiled):
        train_loop.train_and_evaluate(config, workdir)
    schedule = train_optimizer.learning_rate_schedule
    assert (f"longctx: the learning-rate schedule differs from the checkpoint's (train.num_steps: "
            f"checkpoint 2 vs config 4): its cosine decay is re-stretched to end at step 4, and the rate "
            f"of update 3 is {float(schedule(config)(2)):.3g}, where the checkpoint's schedule had "
            f"{float(schedule(_config(2, every_steps=2, log_every=1))(2)):.3g}.\n") in capsys.readouterr().out

    config.train.num_steps = 2
    assert train_loop.train_and_evaluate(config, workdir) == {}
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("longctx: nothing to do: the checkpoint is at step 2 and "
                                    "train.num_steps=2 (raise it to train further)."), out
    assert "schedule differs" not in out  # (saved with num_steps=2 itself)
    assert len(train_iterators) == 3 and all(it.closed for it in train_iterators)


def test_ctrl_c_in_the_script_is_acknowledged_and_stops_saved_and_a_log_has_no_bar(tmp_path):
    """The real script with stdout and stderr redirected (a log): each log line arrives as it is
    written (stdout was block-buffered), stderr holds no progress bar (tqdm redrew it into the file
    at every step); a Ctrl-C is acknowledged on stderr, the run stops at a saved step and says
    "stopped at step N (saved ...)", not "finished", and exits 0."""
    import queue
    import signal
    import threading
    import time

    workdir = str(tmp_path / "run")
    config = _config(10_000, every_steps=0, log_every=1)
    env = {k: v for k, v in os.environ.items() if k not in ("LONGCTX_DEBUG", "XLA_FLAGS")}
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen([sys.executable, TRAIN, f"--workdir={workdir}", *_overrides(config)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=ROOT)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
        reader.start()
        out, deadline = [], time.monotonic() + 300
        try:
            while not any(line.startswith("step 1:") for line in out):
                out.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
        except (queue.Empty, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            pytest.fail(f"no 'step 1:' line while the run trained, or it did not stop: {''.join(out)[-3000:]}")
        reader.join(timeout=60)
        out = "".join(out + list(lines.queue))
        stderr.seek(0)
        err = stderr.read()
    assert proc.returncode == 0, (out + err)[-3000:]
    assert err == "longctx: stopping at the next step (it will be saved); Ctrl-C again to abandon.\n", err[-3000:]
    stopped = [int(n) for n in re.findall(
        rf"^longctx: stopped at step (\d+) \(saved to {re.escape(workdir)}/checkpoints/\1; the same command "
        r"resumes it\); last logged train loss \d", out, re.M)]
    assert len(stopped) == 1 and "finished" not in out, out[-3000:]
    assert _steps(workdir) == stopped


def _take_the_lease_over(workdir) -> None:
    """What another run does that judged this one stale (paused past the stale time): it creates
    the lease's next record, as its own."""
    directory = os.path.join(workdir, lease_lib.LEASE_DIR)
    number = max(int(name.split(".")[0]) for name in os.listdir(directory) if name.endswith(".json")) + 1
    now = time.time()
    taker = lease_lib.Record(run_id="0123456789abcdef", host="elsewhere", pid=4242, machine="elsewhere",
                             pid_start=None, started=now, refreshed=now, refresh_s=10.0)
    with open(os.path.join(directory, f"{number}.json"), "wb") as f:
        f.write(taker.to_json())


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_save(tmp_path, monkeypatch, capsys):
    """Another run takes the lease over during step 3 (this one looked paused); the refresh thread
    has not run since: at step 4, a save step, the run reads the lease, stops with one line naming
    the taker, and saves (and logs) nothing more, so its max_to_keep cannot delete the other's
    checkpoints (not 4, 6 and 8)."""
    workdir = str(tmp_path / "run")
    real = train_steps.jit_steps

    def jit_steps(config, setup):
        train_step, eval_step = real(config, setup)
        calls = itertools.count(1)

        def step(state, batch):
            if next(calls) == 3:
                _take_the_lease_over(workdir)
            return train_step(state, batch)

        step.lower = train_step.lower  # (the loop compiles the jitted step ahead of the first)
        return step, eval_step

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)
    with pytest.raises(errors.RunError) as error:
        train_loop.train_and_evaluate(_config(8, every_steps=2, log_every=4), workdir)
    assert re.fullmatch(
        rf"the lease of workdir {re.escape(workdir)} was taken over by host elsewhere, pid 4242, since [-0-9: ]+ "
        r"UTC while this run had not refreshed it for \d+ s \(paused or starved past the stale time\); stopped "
        r"after step 4 without saving it, so as not to write over that run's checkpoints\. That run goes on in "
        r"this workdir: to go on with this one instead, stop that run and start this command again\.",
        str(error.value)), str(error.value)
    assert _steps(workdir) == [2] and _logged_steps(workdir) == [1]
    assert "lease" not in capsys.readouterr().out  # (said once, by the error)


def test_a_lease_taken_over_during_an_evaluation_is_read_again_before_the_save(tmp_path, capsys):
    """The loop reads the lease at each sync step, then evaluates, then saves: an evaluation takes
    minutes, in which another run may take the lease over. Here the evaluator of step 4, a save
    step, does that; the run reads the lease again before the save, and stops without saving step 4
    over the other run's checkpoints (not at step 6, having saved 4)."""
    workdir = str(tmp_path / "run")

    def build(context):
        def evaluate(params, step):
            if step == 4:
                _take_the_lease_over(workdir)
            return {"score": 1.0}

        return evaluate

    evaluator = hooks.Evaluator(every_key="eval_needle_every", prefix="needle", build=build,
                                log_line=lambda found: "evaluated")
    config = _config(8, every_steps=2, log_every=4)
    config.train.eval_needle_every = 2
    with pytest.raises(errors.RunError, match=r"was taken over by host elsewhere, pid 4242, .*; stopped after "
                                              r"step 4 without saving it"):
        train_loop.train_and_evaluate(config, workdir, evaluators=[evaluator])
    assert _steps(workdir) == [2]
    assert "lease" not in capsys.readouterr().out  # (said once, by the error)


@pytest.fixture
def refuse_writes():
    """`refuse(path)` makes a directory refuse writes, undone at teardown. Permission bits do not
    stop root (which runs these tests here and in CI), so as root the directory is made immutable
    (`chattr +i`: EPERM for everyone, as an immutable or foreign-owned directory fails a user);
    otherwise mode 555 (EACCES). Skipped where neither refuses a write (no CAP_LINUX_IMMUTABLE, a
    file system without the flag)."""
    refused = []

    def refuse(path) -> None:
        path = str(path)
        if os.geteuid() == 0:
            if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
                pytest.skip("chattr +i is not allowed here")
        else:
            os.chmod(path, 0o555)
        refused.append(path)
        try:
            open(os.path.join(path, "probe"), "w").close()
        except OSError:
            return
        os.unlink(os.path.join(path, "probe"))
        pytest.skip(f"{path} still accepts writes")

    yield refuse
    for path in refused:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", path], check=True)
        else:
            os.chmod(path, 0o755)


def _no_compile(monkeypatch):
    class Compiled(Exception):
        pass

    def jit_steps(*_):
        raise Compiled

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)


@pytest.mark.parametrize("validate_only", [False, True])
@pytest.mark.parametrize("directory", ["checkpoints", lease_lib.LEASE_DIR, ""])
def test_a_directory_of_the_workdir_that_refuses_writes_is_one_line_at_start_up(
        tmp_path, monkeypatch, refuse_writes, directory, validate_only):
    """A writable workdir whose checkpoints/ (or .lease/) refuses writes, or a workdir that does:
    one sentence naming the directory and the errno, before anything compiles or is written, and
    the same under --validate_only (which said "fine" for all three). checkpoints/ was found only by
    the first save, 300 s after it began (Orbax's barrier timeout); .lease/ failed as "cannot take
    the run's lease"."""
    workdir = tmp_path / "run"
    refused = workdir / directory
    refused.mkdir(parents=True)
    refuse_writes(refused)
    _no_compile(monkeypatch)
    if validate_only:
        monkeypatch.setenv("LONGCTX_VALIDATE_ONLY", "1")
    with pytest.raises(errors.ConfigError) as error:
        train_loop.train_and_evaluate(_config(2, every_steps=2, log_every=1), str(workdir))
    code = errno.EPERM if os.geteuid() == 0 else errno.EACCES
    assert str(error.value) == (
        f"workdir {str(workdir)!r} is not writable: {str(refused).rstrip('/')}: {os.strerror(code)} (errno {code}); "
        f"make it writable ({errors.WRITABLE_HOW}) or pass another --workdir."), str(error.value)
    assert sorted(os.listdir(workdir)) == sorted([directory] if directory else [])
    assert os.listdir(refused) == []


def test_a_checkpoints_directory_that_refuses_writes_fails_the_save_at_once(tmp_path, monkeypatch, refuse_writes):
    """checkpoints/ starts refusing writes during the run (after the start-up check): the save of
    step 2 fails at once with the errno, the path and advice that fits (not "Free space there"),
    where it waited 300 s for Orbax's step_directory_creation barrier."""
    workdir = tmp_path / "run"
    real = train_steps.jit_steps

    def jit_steps(config, setup):
        train_step, eval_step = real(config, setup)
        calls = itertools.count(1)

        def step(state, batch):
            if next(calls) == 1:
                refuse_writes(workdir / "checkpoints")
            return train_step(state, batch)

        step.lower = train_step.lower  # (the loop compiles the jitted step ahead of the first)
        return step, eval_step

    monkeypatch.setattr(train_loop, "jit_steps", jit_steps)
    with pytest.raises(errors.RunError) as error:
        train_loop.train_and_evaluate(_config(4, every_steps=2, log_every=1), str(workdir))
    code = errno.EPERM if os.geteuid() == 0 else errno.EACCES
    assert str(error.value) == (
        f"could not save checkpoint step 2 to {workdir}/checkpoints ({os.strerror(code)} (errno {code})); no "
        f"complete checkpoint, so the next start begins afresh. {errors.WRITE_DENIED_ADVICE}."), str(error.value)
