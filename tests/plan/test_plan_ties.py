"""A tie is a tie: rows the step-time model cannot tell apart (within its
held-out error of the fastest) are ranked by what it knows better, the plan says so, and
attention.cp=auto takes the row that ranking puts first."""

import copy
import sys

from configs import base
from longctx.plan import auto, hardware, planner, step_time
from tests import child_env
from tests.validate_commands import ScriptServer

V5P_64 = hardware.parse_topology("v5p:4x4x4")


def _rows(**attention):
    c = copy.deepcopy(base.get_config("llama3_8b_128k"))
    c.unlock()
    c.attention.update(**attention)
    c.lock()
    return c, planner.plan(c, V5P_64, open_keys=("attention.cp", "attention.layout"))


def test_rows_within_the_models_error_are_a_tie_ranked_by_what_it_knows_better():
    _, rows = _rows()
    fitting = [r for r in rows if r.fits]
    fastest = min(r.step.seconds for r in fitting)
    tied = [r for r in rows if r.tie]
    # exactly the fitting rows within the held-out error of the fastest, first
    assert {id(r) for r in tied} == {id(r) for r in fitting
                                     if r.step.seconds <= fastest * (1 + step_time.HELD_OUT_ERROR)}
    assert len(tied) > 1 and rows[:len(tied)] == tied
    # ranked by headroom, exposed communication (to 1% of the fastest step), simplicity, time
    key = [(r.memory.total_bytes > planner.COMFORTABLE_HBM * r.hbm_bytes,
            round(r.step.exposed_communication / fastest, 2), planner.simplicity(r.strategy),
            r.step.seconds) for r in tied]
    assert key == sorted(key)
    # the rest by time, after them
    rest = [r.step.seconds for r in rows[len(tied):] if r.fits]
    assert rest == sorted(rest) and all(s > fastest * (1 + step_time.HELD_OUT_ERROR) for s in rest)


def test_without_a_margin_the_fastest_row_is_first():
    """The tie rule only reorders what the model cannot tell apart: with no margin the rows are
    by predicted time."""
    _, rows = _rows()
    untied = planner.break_ties(sorted(rows, key=lambda r: (not r.fits, r.step.seconds)), margin=0.0)
    fitting = [r for r in untied if r.fits]
    assert [r.step.seconds for r in fitting] == sorted(r.step.seconds for r in fitting)


def test_auto_takes_the_row_the_tie_rule_puts_first():
    devices = [type("Device", (), {"device_kind": "TPU v5", "platform": "tpu", "coords": (x, y, z)})()
               for x in range(4) for y in range(4) for z in range(4)]
    c, _ = _rows(cp="auto")
    rows = planner.plan(c, V5P_64, open_keys=planner.auto_keys(c))
    chosen = auto.resolve(c, devices).chosen
    assert chosen.overrides() == rows[0].overrides() and chosen.tie
    fastest = min((r for r in rows if r.fits), key=lambda r: r.step.seconds)
    assert chosen.step.seconds <= fastest.step.seconds * (1 + step_time.HELD_OUT_ERROR)


def test_plan_says_which_rows_are_a_tie_and_why():
    result = ScriptServer.run([sys.executable, "scripts/plan.py", "--config=configs/base.py:llama3_8b_128k",
                               "--topology=v5p:2x2x2", "--seq-len", "32768", "--compile", "0", "--top", "4"],
                              cwd=child_env.ROOT, env=child_env.script_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert (f"are a tie (predicted within {step_time.HELD_OUT_ERROR:.0%} of each other, "
            "the model's held-out error)") in out
    assert "1. " in out and "a tie: " in out.split("\n1. ")[1].split("\n")[0]
