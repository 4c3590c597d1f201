"""Checkpointing end to end: exact resume, SIGTERM, SIGKILL mid-save, other meshes, corruption,
model-shape mismatch, keep policy, init_from.

One module-scoped set of real training runs (scripts/train.py in subprocesses, 8 steps of a
1-layer model on a 2x2x2 mesh, a checkpoint every step) is shared by the tests:

  phase 1, side by side:  ref   8 steps uninterrupted
                          term  the same run, SIGTERM once step 2 is logged
                          kill  the same run, SIGKILL inside the save of step 3, which
                                tests/stalled_save.py holds mid-write (its *.orbax-checkpoint-tmp
                                directory exists, nothing committed) so the kill lands there every time
  phase 2, side by side:  term  resumed to step 8
                          kill  resumed to step 8
                          4dev  a copy of ref cut back to step 4, resumed on 4 devices (mesh 1x2x2)
                          1x1x8 a copy of ref cut back to step 4, resumed on mesh 1x1x8
                          shape ref's workdir with model.d_model changed: must fail, touching nothing

Everything else (bitwise restores onto other meshes, corruption, partial saves, data state that
cannot carry over, init_from, state-structure mismatch) runs in this process on copies of ref's
checkpoints, and the keep policy on its own tiny saves: restores compile nothing big.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from longctx import config as config_lib
from longctx import data as data_lib
from longctx.parallel import mesh as mesh_lib
from longctx.train import checkpoint as checkpoint_lib
from longctx.train import checkpoint_compat, lease
from longctx.train import state as train_state
from tests import ROOT

TRAIN = os.path.join(ROOT, "scripts", "train.py")
STALLED_SAVE = os.path.join(ROOT, "tests", "stalled_save.py")
sys.path.insert(0, ROOT)
from configs import base as base_config  # noqa: E402
from tests import child_env  # noqa: E402

NUM_STEPS = 8
CUT_AT = 4  # the mesh-change runs resume from ref's step CUT_AT
KILL_IN_SAVE_OF = 3  # the kill run's save of this step stalls mid-write; SIGKILL lands there
# Not bitwise on another mesh: float32 end to end, but the cross-device reductions are ordered
# differently (the same tolerance as tests/train/test_multiprocess.py).
LOSS_RTOL = 1e-5
TIMEOUT = 600

FAST = dict(seq_len=512, block_size=64, loss_chunk_size=64, num_layers=1, global_batch_size=4)
OVERRIDES = [
    "--config=configs/base.py:tiny",
    f"--config.train.num_steps={NUM_STEPS}",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.checkpoint.every_steps=1",
    "--config.checkpoint.max_to_keep=100",
    "--config.mesh.dp=2", "--config.mesh.fsdp=2", "--config.mesh.sp=2",
    f"--config.data.seq_len={FAST['seq_len']}",
    f"--config.data.global_batch_size={FAST['global_batch_size']}",
    f"--config.attention.block_size={FAST['block_size']}",
    f"--config.train.loss_chunk_size={FAST['loss_chunk_size']}",
    f"--config.model.num_layers={FAST['num_layers']}",
]


def _config(**mesh):
    """The in-process twin of OVERRIDES (mesh sizes overridable)."""
    c = base_config.get_config("tiny")
    c.train.num_steps, c.train.log_every, c.train.eval_every = NUM_STEPS, 1, 0
    c.checkpoint.every_steps, c.checkpoint.max_to_keep = 1, 100
    c.mesh.dp, c.mesh.fsdp, c.mesh.sp = mesh.get("dp", 2), mesh.get("fsdp", 2), mesh.get("sp", 2)
    c.data.seq_len, c.data.global_batch_size = FAST["seq_len"], FAST["global_batch_size"]
    c.attention.block_size, c.train.loss_chunk_size = FAST["block_size"], FAST["loss_chunk_size"]
    c.model.num_layers = FAST["num_layers"]
    return c


# ----------------------------------------------------------------------------- subprocess helpers


def _env(devices: int = 8) -> dict[str, str]:
    return child_env.script_env(LONGCTX_CPU_DEVICES=str(devices))  # the child's device count


class Run:
    started: list = []

    def __init__(self, name: str, workdir, *extra, devices: int = 8, stall_save_at: int | None = None):
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.log_path = os.path.join(os.path.dirname(self.workdir), name + ".log")
        self.log = open(self.log_path, "w")
        self.marker = os.path.join(os.path.dirname(self.workdir), name + ".mid_save.json")
        # tests/stalled_save.py runs scripts/train.py with the save of `stall_save_at` blocked mid-write.
        program = [TRAIN] if stall_save_at is None else [STALLED_SAVE, f"--stall-step={stall_save_at}",
                                                         f"--marker={self.marker}", "--"]
        self.proc = subprocess.Popen([sys.executable, *program, f"--workdir={self.workdir}", *OVERRIDES, *extra],
                                     cwd=ROOT, env=_env(devices), stdout=self.log, stderr=subprocess.STDOUT)
        Run.started.append(self)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait(self) -> int:
        try:
            rc = self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        return rc


def _logged(workdir, key="train/loss") -> dict[int, list[float]]:
    """Every value logged for each step (a step re-run after a kill appears twice)."""
    out: dict[int, list[float]] = {}
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in row:
                out.setdefault(int(row["step"]), []).append(row[key])
    return out


def _steps(workdir) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _tmp_dirs(workdir) -> list[str]:
    return sorted(glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*")))


def _snapshot(directory) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, but the lease's (.lease/ says which run held the workdir last: a
    run refused by its checks held it while it checked)."""
    out = {}
    for dirpath, _, files in os.walk(directory):
        if os.path.relpath(dirpath, directory).split(os.sep)[0] == lease.LEASE_DIR:
            continue
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns)
    return out


def _copy_cut(source, destination, last_step: int) -> str:
    """A copy of a workdir's checkpoints with the steps after `last_step` left out."""
    os.makedirs(os.path.join(destination, "checkpoints"))
    for step in _steps(source):
        if step <= last_step:
            shutil.copytree(os.path.join(source, "checkpoints", str(step)),
                            os.path.join(destination, "checkpoints", str(step)))
    return str(destination)


def _plant_partial_save(workdir) -> str:
    """What a kill mid-save leaves: `<newest + 1>.orbax-checkpoint-tmp`, uncommitted, an array file cut short."""
    newest = max(_steps(workdir))
    partial = os.path.join(workdir, "checkpoints", f"{newest + 1}.orbax-checkpoint-tmp")
    shutil.copytree(os.path.join(workdir, "checkpoints", str(newest)), partial)
    for path in glob.glob(os.path.join(partial, "**", "commit_success.txt"), recursive=True):
        os.remove(path)
    files = [p for p in glob.glob(os.path.join(partial, "state", "**", "*"), recursive=True) if os.path.isfile(p)]
    biggest = max(files, key=os.path.getsize)
    os.truncate(biggest, os.path.getsize(biggest) // 2)
    return partial


def _wait_for(predicate, proc, what: str, timeout: float = TIMEOUT, interval: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started: list[Run] = []
    Run.started = started
    try:
        yield _runs(tmp_path_factory.mktemp("ckpt"))
    finally:
        for run in started:  # a failed fixture leaves no training process behind
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


def _runs(base):
    t0 = time.monotonic()
    ref, term = Run("ref", base / "ref"), Run("term", base / "term")
    kill = Run("kill", base / "kill", stall_save_at=KILL_IN_SAVE_OF)
    out = {"kill_pid": kill.proc.pid}

    # SIGTERM once step 2 is in metrics.jsonl: the loop finishes its step, saves and exits 0.
    if _wait_for(lambda: 2 in _logged(term.workdir), term.proc, "term step 2"):
        term.proc.send_signal(signal.SIGTERM)
    # SIGKILL inside a real save: the stalled save's hook has written its marker, so the step's
    # *.orbax-checkpoint-tmp directory exists and the save cannot have been committed.
    mid_save = _wait_for(lambda: os.path.exists(kill.marker), kill.proc, "the kill run's stalled save")
    out["kill_alive_at_kill"] = kill.proc.poll() is None
    if mid_save:
        with open(kill.marker) as f:
            out["kill_marker"] = json.load(f)
        out["kill_tmp_at_kill"], out["kill_steps_at_kill"] = _tmp_dirs(kill.workdir), _steps(kill.workdir)
    kill.proc.kill()
    out.update({"ref_rc": ref.wait(), "term_rc": term.wait(), "kill_rc": kill.wait(), "base": base,
                "ref": ref.workdir, "term": term.workdir, "kill": kill.workdir,
                "term_out1": term.output(), "ref_out": ref.output(), "kill_out1": kill.output()})
    assert out["ref_rc"] == 0, ref.output()[-3000:]
    out["kill_tmp_after_kill"] = _tmp_dirs(kill.workdir)
    out["kill_steps_after_kill"] = _steps(kill.workdir)
    out["killed_mid_save"] = mid_save and out["kill_alive_at_kill"]
    out["phase1_s"] = time.monotonic() - t0

    four = _copy_cut(ref.workdir, base / "four", CUT_AT)
    one_one_eight = _copy_cut(ref.workdir, base / "one_one_eight", CUT_AT)
    ulysses = _copy_cut(ref.workdir, base / "ulysses", CUT_AT)
    ref_snapshot = _snapshot(ref.workdir)
    phase2 = {
        "term2": Run("term2", term.workdir),
        "kill2": Run("kill2", kill.workdir),
        "four": Run("four", four, "--config.mesh.dp=1", "--config.mesh.fsdp=2", "--config.mesh.sp=2", devices=4),
        "one_one_eight": Run("one_one_eight", one_one_eight, "--config.mesh.dp=1", "--config.mesh.fsdp=1", "--config.mesh.sp=8"),
        # saved by the ring, resumed by Ulysses: the parameters do not depend on the strategy
        "ulysses": Run("ulysses", ulysses, "--config.attention.cp=ulysses"),
        "shape": Run("shape", ref.workdir, "--config.model.d_model=64"),
    }
    for name, run in phase2.items():
        out[f"{name}_rc"] = run.wait()
        out[f"{name}_out"] = run.output()
        out[name] = run.workdir
    out["ref_snapshot_before_shape"], out["ref_snapshot_after_shape"] = ref_snapshot, _snapshot(ref.workdir)
    out["total_s"] = time.monotonic() - t0
    print(f"checkpoint runs: phase 1 {out['phase1_s']:.0f}s, total {out['total_s']:.0f}s; "
          f"killed mid-save: {out['killed_mid_save']}")
    return out


def _restore_raw(workdir, step):
    """A step's saved state as numpy, restored with the shardings it was saved with."""
    path = os.path.join(workdir, "checkpoints", str(step), "state")
    with ocp.StandardCheckpointer() as ckptr:
        return jax.tree.map(np.asarray, ckptr.restore(path))


def _assert_states_equal(a, b):
    fa, fb = checkpoint_compat.flat_arrays(a), checkpoint_compat.flat_arrays(b)
    assert fa == fb
    la = dict(zip(fa, jax.tree.leaves(a)))
    lb = dict(zip(fb, jax.tree.leaves(b)))
    unequal = [k for k in la if not np.array_equal(np.asarray(la[k]), np.asarray(lb[k]))]
    assert not unequal, f"arrays differ: {unequal[:5]}"


def _data_state(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "data", "process_0-of-1.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- exact resume, SIGTERM


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(runs):
    assert runs["term_rc"] == 0, runs["term_out1"][-3000:]
    m = re.search(r"longctx: stopped at step (\d+) \(saved to (\S+)/\1;", runs["term_out1"])
    assert m, runs["term_out1"][-3000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < NUM_STEPS
    assert m.group(2) == os.path.join(runs["term"], "checkpoints")
    assert max(_steps(runs["term"])) >= stopped
    assert f"resumed from {runs['term']}/checkpoints/{stopped} (step {stopped}), data iterator included" \
        in runs["term2_out"], runs["term2_out"][-3000:]
    assert runs["term2_rc"] == 0, runs["term2_out"][-3000:]


@pytest.mark.slow
def test_resume_is_the_same_run(runs):
    """Stop (SIGTERM) at step s, resume: every step's loss and grad norm is bitwise the uninterrupted
    run's, the data iterator is in the same state after every saved step, and so is the train state."""
    for key in ("train/loss", "train/grad_norm"):
        ref, resumed = _logged(runs["ref"], key), _logged(runs["term"], key)
        assert sorted(ref) == list(range(1, NUM_STEPS + 1))
        assert {s: v for s, v in resumed.items()} == {s: [v[0]] for s, v in ref.items()}, key
    for step in _steps(runs["term"]):
        assert _data_state(runs["term"], step) == _data_state(runs["ref"], step), step
    # Mid-run (an async save followed by donated steps) and final states, bitwise.
    for step in (NUM_STEPS - 1, NUM_STEPS):
        _assert_states_equal(_restore_raw(runs["term"], step), _restore_raw(runs["ref"], step))


# ----------------------------------------------------------------------------- SIGKILL mid-save


@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_previous_complete(runs):
    # The SIGKILL landed inside a real save of step KILL_IN_SAVE_OF (tests/stalled_save.py held it
    # mid-write): the process was alive, the step's tmp directory existed, nothing of it committed.
    assert runs["killed_mid_save"], runs["kill_out1"][-3000:]
    assert runs["kill_rc"] == -signal.SIGKILL
    marker = runs["kill_marker"]
    assert marker["step"] == KILL_IN_SAVE_OF and marker["pid"] == runs["kill_pid"], marker
    assert re.fullmatch(rf"{KILL_IN_SAVE_OF}\.orbax-checkpoint-tmp.*", os.path.basename(marker["tmp_dir"]))
    assert marker["tmp_dir"] in runs["kill_tmp_at_kill"] and marker["tmp_dir"] in runs["kill_tmp_after_kill"]
    assert runs["kill_steps_at_kill"] == runs["kill_steps_after_kill"] == list(range(1, KILL_IN_SAVE_OF))
    out = runs["kill2_out"]
    newest_complete = max(runs["kill_steps_after_kill"])
    assert runs["kill2_rc"] == 0, out[-3000:]
    assert f"resumed from {runs['kill']}/checkpoints/{newest_complete} (step {newest_complete})" in out, out[-3000:]
    assert "WARNING" not in out and not os.path.exists(os.path.join(runs["kill"], "checkpoints_unreadable"))
    # The step that was being written was redone and saved for real; the run is still the same run.
    assert _steps(runs["kill"]) == list(range(1, NUM_STEPS + 1))
    assert not _tmp_dirs(runs["kill"])
    ref = _logged(runs["ref"])
    for step, values in _logged(runs["kill"]).items():
        assert all(v == ref[step][0] for v in values), (step, values, ref[step])
    _assert_states_equal(_restore_raw(runs["kill"], NUM_STEPS), _restore_raw(runs["ref"], NUM_STEPS))


@pytest.mark.slow
def test_partial_save_is_never_read(runs, tmp_path, capsys):
    """The same, deterministic: a partial save left by hand is invisible to the restore."""
    workdir = _copy_cut(runs["ref"], tmp_path / "w", 5)
    partial = _plant_partial_save(workdir)
    _, state, iterator, note = _restore_in_process(workdir, _config())
    iterator.close()
    assert note.startswith(f"resumed from {workdir}/checkpoints/5 (step 5)"), note
    assert note.endswith("; the save of step 6 was never finished (the run stopped while writing it), so it is "
                         "not a checkpoint"), note
    assert int(state.step) == 5 and os.path.isdir(partial)
    assert "WARNING" not in capsys.readouterr().out
    assert not os.path.exists(os.path.join(workdir, "checkpoints_unreadable"))


def test_unfinished_saves_are_the_steps_of_orbax_tmp_directories(tmp_path):
    from etils import epath
    directory = epath.Path(tmp_path / "checkpoints")
    assert checkpoint_lib.unfinished_saves(directory) == []
    for name in ("5", "7.orbax-checkpoint-tmp-1733480000", "12.orbax-checkpoint-tmp", "notes.orbax-checkpoint-tmp"):
        (directory / name).mkdir(parents=True)
    assert checkpoint_lib.unfinished_saves(directory) == [7, 12]
    assert checkpoint_lib.unfinished_note([]) == ""
    assert checkpoint_lib.unfinished_note([7, 12]) == ("; the saves of steps 7, 12 were never finished (a run "
                                                       "stopped while writing them), so they are not checkpoints")


# ----------------------------------------------------------------------------- other meshes


def _assert_close_losses(runs, name):
    out = runs[f"{name}_out"]
    assert runs[f"{name}_rc"] == 0, out[-3000:]
    assert f"(step {CUT_AT}), data iterator included" in out, out[-3000:]
    ref, resumed = _logged(runs["ref"]), _logged(runs[name])
    assert sorted(resumed) == list(range(CUT_AT + 1, NUM_STEPS + 1))
    for step in range(CUT_AT + 1, NUM_STEPS + 1):
        np.testing.assert_allclose(resumed[step], ref[step], rtol=LOSS_RTOL, err_msg=str(step))


@pytest.mark.slow
def test_resume_on_four_devices(runs):
    assert "4 cpu devices, mesh {'dp': 1, 'fsdp': 2, 'sp': 2}" in runs["four_out"]
    _assert_close_losses(runs, "four")


@pytest.mark.slow
def test_resume_on_mesh_1x1x8(runs):
    assert "8 cpu devices, mesh {'dp': 1, 'fsdp': 1, 'sp': 8}" in runs["one_one_eight_out"]
    _assert_close_losses(runs, "one_one_eight")


@pytest.mark.slow
def test_resume_under_another_context_parallel_strategy(runs):
    _assert_close_losses(runs, "ulysses")


def _restore_in_process(workdir, config, devices=None):
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    layout = train_state.resolve_layout(config, mesh.shape["sp"])
    data_dir = data_lib.resolve_dataset(config)
    setup = train_state.make_setup(config, mesh, layout)

    def make_iterator(seed_offset=0):
        return data_lib.make_batch_iterator(config, mesh, split="train", layout=layout, data_dir=data_dir,
                                            seed_offset=seed_offset)

    checkpointer = checkpoint_lib.Checkpointer(workdir, config)
    with jax.set_mesh(mesh):
        state, iterator, note = checkpointer.restore_or_init(setup, make_iterator)
    checkpointer.close()
    return mesh, state, iterator, note


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,num_devices", [((1, 1, 8), 8), ((1, 2, 2), 4)])
def test_restore_onto_other_mesh_is_exact(runs, mesh_shape, num_devices):
    """Saved on 2x2x2, restored onto another mesh: every array bitwise, resharded on load; the
    data iterator state carries over (same process count)."""
    dp, fsdp, sp = mesh_shape
    config = _config(dp=dp, fsdp=fsdp, sp=sp)
    mesh, state, iterator, note = _restore_in_process(runs["ref"], config, jax.devices()[:num_devices])
    assert note.endswith(f"(step {NUM_STEPS}), data iterator included"), note
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.mesh.shape == dict(zip(mesh_lib.MESH_AXES, mesh_shape))
        assert len(leaf.sharding.device_set) == num_devices
    _assert_states_equal(jax.tree.map(np.asarray, state), _restore_raw(runs["ref"], NUM_STEPS))
    assert iterator.get_state() == _data_state(runs["ref"], NUM_STEPS)
    batch = next(iterator)
    assert batch["tokens"].shape == (FAST["global_batch_size"], FAST["seq_len"])
    iterator.close()


def _first_tokens(iterator):
    return np.asarray(jax.device_get(next(iterator)["tokens"]))


@pytest.mark.slow
def test_data_state_that_cannot_carry_over_restarts_the_stream(runs, tmp_path):
    """Another process count, or another data stream: the train state restores, the data stream
    restarts from a fresh shuffle seeded with the step, and the sentence says so."""
    workdir = _copy_cut(runs["ref"], tmp_path / "w", NUM_STEPS)
    path = os.path.join(workdir, "checkpoints", str(NUM_STEPS), "metadata", "metadata")
    with open(path) as f:
        metadata = json.load(f)
    metadata["process_count"] = 2  # as if saved by 2 processes
    with open(path, "w") as f:
        json.dump(metadata, f)
    config = _config()
    mesh, state, iterator, note = _restore_in_process(workdir, config)
    assert note.endswith(f"(step {NUM_STEPS}); the data iterator state was saved by 2 process(es) and this run "
                         f"has 1, so data restarts from a fresh shuffle seeded with step {NUM_STEPS}"), note
    _assert_states_equal(jax.tree.map(np.asarray, state), _restore_raw(runs["ref"], NUM_STEPS))
    layout = train_state.resolve_layout(config, mesh.shape["sp"])
    fresh = data_lib.make_batch_iterator(config, mesh, split="train", layout=layout,
                                         data_dir=data_lib.resolve_dataset(config), seed_offset=NUM_STEPS)
    np.testing.assert_array_equal(_first_tokens(iterator), _first_tokens(fresh))
    iterator.close()
    fresh.close()

    metadata["process_count"] = 1
    with open(path, "w") as f:
        json.dump(metadata, f)
    config = _config()
    config.data.shuffle_seed = 1
    _, _, iterator, note = _restore_in_process(workdir, config)
    iterator.close()
    assert note.endswith("the data iterator state belongs to another data stream (data.shuffle_seed: "
                         f"checkpoint 0 vs config 1), so data restarts from a fresh shuffle seeded with step "
                         f"{NUM_STEPS}"), note
    assert not os.path.exists(os.path.join(workdir, "checkpoints_unreadable"))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.slow
def test_model_shape_mismatch_fails_before_touching_anything(runs):
    out = runs["shape_out"]
    assert runs["shape_rc"] != 0
    assert re.search(r"^longctx: .*model\.d_model: checkpoint 128 vs config 64", out, re.M), out[-3000:]
    assert "compiled" not in out
    assert runs["ref_snapshot_after_shape"] == runs["ref_snapshot_before_shape"]


@pytest.mark.slow
def test_state_structure_mismatch_is_an_error_not_corruption(runs, tmp_path):
    """Same model, another optimizer chain (no clipping): a ConfigError listing the arrays; nothing
    is moved aside."""
    workdir = _copy_cut(runs["ref"], tmp_path / "w", NUM_STEPS)
    before = _snapshot(workdir)
    config = _config()
    config.optimizer.grad_clip_norm = None
    with pytest.raises(config_lib.ConfigError, match=r"does not fit this run's.*opt_state/"):
        _restore_in_process(workdir, config)
    assert _snapshot(workdir) == before
    # Parameters that exist only in this run (attention sinks) are caught by the config check.
    config = _config()
    config.attention.attention_sinks = True
    with pytest.raises(config_lib.ConfigError, match="attention.attention_sinks: checkpoint False vs config True"):
        checkpoint_lib.Checkpointer(workdir, config)
    assert _snapshot(workdir) == before


@pytest.mark.slow
# Orbax's cancelled reads of the truncated step report themselves as unraisable exceptions.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_checkpoint_is_set_aside(runs, tmp_path, capsys):
    workdir = _copy_cut(runs["ref"], tmp_path / "w", NUM_STEPS)
    newest = os.path.join(workdir, "checkpoints", str(NUM_STEPS))
    files = [p for p in glob.glob(os.path.join(newest, "state", "**", "*"), recursive=True) if os.path.isfile(p)]
    biggest = max(files, key=os.path.getsize)
    os.truncate(biggest, os.path.getsize(biggest) // 2)
    saved_files = sorted(os.path.relpath(p, newest) for p in glob.glob(os.path.join(newest, "**"), recursive=True))

    _, state, iterator, note = _restore_in_process(workdir, _config())
    out = capsys.readouterr().out
    assert f"WARNING: checkpoint {newest} could not be restored" in out, out
    assert note.startswith(f"resumed from {workdir}/checkpoints/{NUM_STEPS - 1} (step {NUM_STEPS - 1})"), note
    assert int(state.step) == NUM_STEPS - 1
    _assert_states_equal(jax.tree.map(np.asarray, state), _restore_raw(runs["ref"], NUM_STEPS - 1))
    assert iterator.get_state() == _data_state(runs["ref"], NUM_STEPS - 1)
    iterator.close()
    # Moved aside whole, not deleted.
    assert _steps(workdir) == list(range(1, NUM_STEPS))
    (aside,) = glob.glob(os.path.join(workdir, "checkpoints_unreadable", f"{NUM_STEPS}-*"))
    assert sorted(os.path.relpath(p, aside) for p in glob.glob(os.path.join(aside, "**"), recursive=True)) \
        == saved_files


# ----------------------------------------------------------------------------- init_from, keep policy


@pytest.mark.slow
def test_init_from_takes_parameters_only(runs, tmp_path):
    config = _config()
    config.checkpoint.init_from = runs["ref"]
    config.optimizer.grad_clip_norm = None  # another optimizer chain: its state is never read
    _, state, iterator, note = _restore_in_process(str(tmp_path / "new"), config)
    iterator.close()
    assert note == (f"fresh start with parameters from {runs['ref']}/checkpoints/{NUM_STEPS} "
                    "and a fresh optimizer state"), note
    saved = _restore_raw(runs["ref"], NUM_STEPS)
    _assert_states_equal(jax.tree.map(np.asarray, state.params), saved["params"])
    assert int(state.step) == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state[0].mu))
    # A step directory works too, and a model of another shape is refused up front.
    config.checkpoint.init_from = os.path.join(runs["ref"], "checkpoints", "3")
    _, state3, iterator, note = _restore_in_process(str(tmp_path / "new3"), config)
    iterator.close()
    assert note.startswith(f"fresh start with parameters from {runs['ref']}/checkpoints/3 ")
    _assert_states_equal(jax.tree.map(np.asarray, state3.params), _restore_raw(runs["ref"], 3)["params"])
    config.model.mlp_dim = 256
    with pytest.raises(config_lib.ConfigError, match="model.mlp_dim: checkpoint 384 vs config 256"):
        checkpoint_lib.Checkpointer(str(tmp_path / "new_other"), config)
    config.checkpoint.init_from = str(tmp_path / "nowhere")
    with pytest.raises(config_lib.ConfigError, match="does not exist"):
        checkpoint_lib.Checkpointer(str(tmp_path / "new_other"), config)


def test_keep_policy(tmp_path):
    """max_to_keep newest, plus every keep_period-th step for good; also across a restart."""
    config = _config(dp=1, fsdp=4, sp=2)
    config.checkpoint.max_to_keep, config.checkpoint.keep_period = 2, 4
    mesh = mesh_lib.make_mesh(config.mesh)
    data_dir = data_lib.resolve_dataset(config)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        state = setup.init(jax.random.PRNGKey(0))
        iterator = data_lib.make_batch_iterator(config, mesh, split="train", layout="contiguous",
                                                data_dir=data_dir)
        workdir = str(tmp_path / "w")
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        for step in range(1, 11):
            checkpointer.maybe_save(step, state, iterator)
        checkpointer.close()
        assert _steps(workdir) == [4, 8, 9, 10]
        config.checkpoint.every_steps = 3  # a restart, saving every 3rd step
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        for step in range(11, 16):
            checkpointer.maybe_save(step, state, iterator)
        assert not checkpointer.maybe_save(15, state, iterator, force=True)  # already saved
        checkpointer.close()
    iterator.close()
    assert _steps(workdir) == [4, 8, 12, 15]


# ----------------------------------------------------------------------------- data iterator state

# The data keys that do not define the training stream, and why. Every other data key must be in
# STREAM_KEYS: a new key has to be placed on one side or the other.
NOT_STREAM_KEYS = {
    "data.cache_dir": "where the embedded corpus is prepared; the dataset's fingerprint is checked",
    "data.prefetch_buffer_size": "how far ahead batches are read, not which",
    "data.sources": "a mixture's sources are checked one by one (mixture.py: each state's id; "
                    "checkpoint_compat.mixture_notice), and a changed source restarts alone",
}


def _stream_record(**dataset):
    return {"shards": {"0": {"index": 0, "count": 2, "rows": [0, 2]},
                       "1": {"index": 1, "count": 2, "rows": [2, 4]}},
            "dataset": {"tokenizer": "byte", "vocab_size": 259, "pad_id": 258, "split": "train",
                        "num_documents": 90, "num_tokens": 9000,
                        "files": [{"path": "train-00000.array_record", "num_documents": 90,
                                   "num_tokens": 9000, "bytes": 36500}], **dataset}}


def _mismatch(saved_config=None, saved_record=None, current_record=None, process_count=2):
    config = _config().to_dict()
    metadata = {"process_count": 2}
    if saved_record is not False:
        metadata[checkpoint_compat.DATA_STREAM] = saved_record or _stream_record()
    return checkpoint_compat.data_state_mismatch(saved_config or config, metadata, config,
                                                 current_record or _stream_record(), process_count)


def test_every_data_key_is_classified():
    keys = {f"data.{k}" for k in _config().data}
    assert set(checkpoint_compat.STREAM_KEYS) <= keys
    assert keys - set(checkpoint_compat.STREAM_KEYS) == set(NOT_STREAM_KEYS)


@pytest.mark.parametrize("key", checkpoint_compat.STREAM_KEYS)
def test_any_stream_key_that_differs_restarts_the_stream(key):
    saved = _config().to_dict()
    section, name = key.split(".")
    current = saved[section][name]
    other = current + ("_other" if isinstance(current, str) else 1)
    saved[section][name] = other
    assert _mismatch(saved_config=saved) == (
        f"belongs to another data stream ({key}: checkpoint {other!r} vs config {current!r})")


def test_same_stream_shards_and_dataset_restore_the_state():
    assert _mismatch() is None


def test_another_process_count_restarts_the_stream():
    assert _mismatch(process_count=1) == "was saved by 2 process(es) and this run has 1"


def test_another_process_to_data_shard_map_restarts_the_stream():
    """dp=2 over two processes -> one sp group spanning both: each would restore its own state."""
    one_group = _stream_record()
    one_group["shards"] = {"0": {"index": 0, "count": 1, "rows": [0, 4]},
                           "1": {"index": 0, "count": 1, "rows": [0, 4]}}
    assert _mismatch(current_record=one_group) == (
        "was saved under another process -> data shard map (process 0: data shard 0 of 2, batch "
        "rows 0-1 then, data shard 0 of 1, batch rows 0-3 now; process 1: data shard 1 of 2, "
        "batch rows 2-3 then, data shard 0 of 1, batch rows 0-3 now)")


def test_another_dataset_restarts_the_stream():
    grown = _stream_record(num_documents=91)
    grown["dataset"]["files"][0].update(num_documents=91, bytes=36900)
    assert _mismatch(current_record=grown) == (
        "belongs to another dataset (num_documents: 90 then vs 91 now; train-00000.array_record "
        "bytes: 36500 then vs 36900 now; train-00000.array_record num_documents: 90 then vs 91 now)")
    assert _mismatch(current_record=_stream_record(tokenizer="sentencepiece:tokenizer.model")) == (
        "belongs to another dataset (tokenizer: 'byte' then vs 'sentencepiece:tokenizer.model' now)")


def test_a_state_saved_without_its_record_restarts_the_stream():
    assert _mismatch(saved_record=False) == (
        "was saved without a record of its data shards and dataset (an older longctx)")


def test_dataset_replaced_at_the_same_path_restarts_the_stream(tmp_path):
    """Saved, then the same path re-prepared: from the same input (byte-identical) the state
    restores; from another corpus the stream restarts, and the note says what changed."""
    from longctx.data import prepare
    from tests.synthetic import make_corpus

    data = str(tmp_path / "data")

    def prepare_from(seed):
        (tmp_path / f"corpus{seed}").mkdir(exist_ok=True)
        prepare.prepare([str(make_corpus(tmp_path / f"corpus{seed}", seed=seed))], data,
                        overwrite=True, val_fraction=0.1, progress=False)

    prepare_from(0)
    config = _config(dp=1, fsdp=1, sp=1)  # one device: quicker, and the data shard is the same
    config.data.path = data
    devices = jax.devices()[:1]
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    workdir = str(tmp_path / "w")
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        iterator = data_lib.make_batch_iterator(config, mesh, split="train", layout="contiguous",
                                                data_dir=data)
        next(iterator)
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        assert checkpointer.maybe_save(1, setup.init(jax.random.PRNGKey(0)), iterator, force=True)
        checkpointer.close()
        iterator.close()

    prepare_from(0)  # the same input again: the same bytes
    _, _, iterator, note = _restore_in_process(workdir, config, devices)
    iterator.close()
    assert note.endswith("(step 1), data iterator included"), note

    prepare_from(1)  # another corpus at the same path
    saved = json.loads((tmp_path / "w" / "checkpoints" / "1" / "metadata" / "metadata").read_text())
    now = data_lib.load_metadata(data)["splits"]["train"]
    _, _, iterator, note = _restore_in_process(workdir, config, devices)
    iterator.close()
    was = saved[checkpoint_compat.DATA_STREAM]["dataset"]
    assert was["num_tokens"] != now["num_tokens"]
    assert f"(step 1); the data iterator state belongs to another dataset (num_tokens: " \
        f"{was['num_tokens']} then vs {now['num_tokens']} now; " in note, note
    assert note.endswith(", so data restarts from a fresh shuffle seeded with step 1"), note
