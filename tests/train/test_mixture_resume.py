"""SIGKILL after a checkpoint, then the same command again, with a 3-source mixture (data.sources):
the same batches and the same losses, bitwise, as the uninterrupted run.

tests/train/test_checkpoint.py does this for one source; its set-up is reused here (its `Run`
starts scripts/train.py with its overrides, 2x2x2 mesh, 1 layer, 512 tokens, and
tests/stalled_save.py holds one save mid-write so that the SIGKILL lands after the checkpoint
before it, every time). Two runs side by side, then one:

  ref    6 steps uninterrupted, a checkpoint every 2
  kill   the same run, its save of step 4 held mid-write; SIGKILL once it is held (step 2 is
         committed by then: Orbax finishes one async save before it starts the next)
  kill2  the same command again: resumes from step 2 and runs to 6

The batches are compared through the data iterator's saved state at every checkpoint (each
source's iterator and the mixer's token counts: the next batch is a function of it) and the
losses and gradient norms of every step, including the steps the killed run logged before it died.
"""

import os
import signal

import pytest

from tests.data.mixture_sources import WEIGHTS, prepare_sources, sources_override
from tests.train.test_checkpoint import Run, _data_state, _logged, _steps, _wait_for

NUM_STEPS, EVERY, KILL_IN_SAVE_OF = 6, 2, 4
KEYS = ("train/loss", "train/grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixture_resume")
    flags = [sources_override(prepare_sources(base)), f"--config.train.num_steps={NUM_STEPS}",
             f"--config.checkpoint.every_steps={EVERY}"]
    started = Run.started = []
    try:
        ref = Run("ref", base / "ref", *flags)
        kill = Run("kill", base / "kill", *flags, stall_save_at=KILL_IN_SAVE_OF)
        held = _wait_for(lambda: os.path.exists(kill.marker), kill.proc, "the kill run's held save")
        alive = kill.proc.poll() is None
        steps_at_kill = _steps(kill.workdir)
        kill.proc.kill()
        out = {"ref_rc": ref.wait(), "kill_rc": kill.wait(), "held": held and alive,
               "steps_at_kill": steps_at_kill, "first_life": {k: _logged(kill.workdir, k) for k in KEYS}, "kill_out": kill.output(), "ref_out": ref.output(),
               "ref": ref.workdir, "kill": kill.workdir}
        kill2 = Run("kill2", base / "kill", *flags)
        out.update(kill2_rc=kill2.wait(), kill2_out=kill2.output())
        return out
    finally:
        for run in started:  # a failed fixture leaves no training process behind
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


@pytest.mark.slow
def test_sigkill_and_restart_of_a_mixture_is_the_same_run(runs):
    assert runs["ref_rc"] == 0, runs["ref_out"][-3000:]
    assert "data mixture by tokens over the first 200 rows: books " in runs["ref_out"]
    # Killed after the checkpoint of step 2, inside the save of step 4.
    assert runs["held"] and runs["kill_rc"] == -signal.SIGKILL, runs["kill_out"][-3000:]
    assert runs["steps_at_kill"] == [2]
    out = runs["kill2_out"]
    assert runs["kill2_rc"] == 0, out[-3000:]
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert resumed == [f"longctx: resumed from {runs['kill']}/checkpoints/2 (step 2), data iterator included; the "
                       "save of step 4 was never finished (the run stopped while writing it), so it is not a "
                       "checkpoint"], resumed

    # The same batches: the data state at every checkpoint is the uninterrupted run's, and it is a
    # mixture's (every source's own iterator, moved on from where it started).
    assert _steps(runs["kill"]) == _steps(runs["ref"]) == [2, 4, 6]
    for step in (2, 4, 6):
        assert _data_state(runs["kill"], step) == _data_state(runs["ref"], step), step
    final = _data_state(runs["ref"], NUM_STEPS)
    assert set(final["sources"]) == set(WEIGHTS) and set(final["tokens"]) == set(WEIGHTS)
    assert all(n > 0 for n in final["tokens"].values()), final["tokens"]

    # The same losses, bitwise: every step the killed run logged before it died (at least step 3,
    # past the checkpoint it resumed from) and every step of the resumed run.
    for key in KEYS:
        ref, first, resumed = _logged(runs["ref"], key), runs["first_life"][key], _logged(runs["kill"], key)
        assert sorted(ref) == sorted(resumed) == list(range(1, NUM_STEPS + 1)), key
        assert 3 in first, first
        for step, values in (*first.items(), *resumed.items()):
            assert values == [ref[step][0]], (key, step, values, ref[step])
