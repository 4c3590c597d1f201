"""Every flag of every script that takes a number refuses a value outside its range, and one that
is not a number, in one line naming the flag (exit status 2, no traceback), while the command line
is parsed: before any work, under --validate_only too.

The walk (tests/walk_script_flags.py) parses each flag of each script in one process; a few real
command lines (the ones a user ran into) go through the scripts as they run.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr

import pytest

from longctx import cli
from tests.validate_commands import ScriptServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUES = ("0", "-1", "x")
# Flags where 0 means something (their help says so); every other number flag starts at 1. No
# flag takes a negative value.
ZERO_IS_MEANINGFUL = {
    ("scripts/convert_hf.py check-logits", "--block-size"): "0: the block is chosen",
    ("scripts/convert_hf.py check-logits", "--tolerance"): "an exact match",
    ("scripts/eval_needle.py", "--seed"): "a seed",
    ("scripts/eval_ruler.py", "--seed"): "a seed",
    ("scripts/ring_report.py", "--seed"): "a seed",
    ("scripts/ring_report.py", "--sliding-window"): "a window of the query alone (masks allow 0)",
    ("scripts/prepare_data.py", "--val-fraction"): "no validation split",
    ("scripts/plan.py", "--compile"): "0: no compile",
}
# Flags a walk must reach (each once failed in a way the walk would have found).
MUST_BE_WALKED = {("scripts/ring_report.py", "--tokens"), ("scripts/ring_report.py", "--batch-size"),
                  ("scripts/ring_report.py", "--batches"), ("scripts/plan.py", "--top"),
                  ("scripts/estimate.py", "--sweep_start_shard"), ("scripts/eval_needle.py", "--samples")}


@pytest.fixture(scope="module")
def walked():
    env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, cli.VALIDATE_ENV)}
    r = ScriptServer.run([sys.executable, os.path.join(ROOT, "tests", "walk_script_flags.py"), *VALUES],
                         cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["results"], json.loads(r.stdout)["scripts"]


def test_the_walk_reaches_every_script_and_the_flags_found_failing(walked):
    results, scripts = walked
    assert sorted(scripts) == sorted(os.path.relpath(p, ROOT)
                                     for p in glob.glob(os.path.join(ROOT, "scripts", "*.py")))
    assert not [s for s, kind in scripts.items() if kind is None], (
        "an argparse script builds its parser in build_parser() (so that its flags can be walked)")
    assert MUST_BE_WALKED <= {(r["script"], r["flag"]) for r in results}


def test_every_number_flag_refuses_what_is_out_of_range_in_one_line_naming_it(walked):
    wrong = []
    for r in walked[0]:
        allowed = r["value"] == "0" and (r["script"], r["flag"]) in ZERO_IS_MEANINGFUL
        if allowed != r["accepted"]:
            wrong.append(f"{r['script']} {r['flag']}={r['value']}: "
                         f"{'accepted' if r['accepted'] else 'refused: ' + r['line']}")
        elif not r["accepted"] and not (r["status"] == 2 and r["flag"] in r["line"]
                                        and "\n" not in r["line"] and "Traceback" not in r["line"]):
            wrong.append(f"{r['script']} {r['flag']}={r['value']}: status {r['status']}: {r['line']!r}")
    assert not wrong, "\n".join(wrong)


def test_a_flag_where_0_means_something_says_so_in_its_help(walked):
    helps = {(r["script"], r["flag"]): r["help"] for r in walked[0]}
    assert set(ZERO_IS_MEANINGFUL) <= set(helps)
    assert not [flag for flag in ZERO_IS_MEANINGFUL if "0" not in helps[flag]]


def test_ring_report_names_the_flag_under_validate_only_as_it_runs():
    """Three command lines run as scripts (forked after the imports)."""
    base = [sys.executable, "scripts/ring_report.py", "--seq-len", "8192", "--sp", "4", "--block", "256",
            "--causal", "--mix", "uniform", "--validate_only"]
    cases = {"--tokens": "0", "--batch-size": "0", "--batches": "0"}
    commands = [{"argv": base + [flag, value]} for flag, value in cases.items()]
    env = {k: v for k, v in os.environ.items() if k not in (cli.DEBUG_ENV, cli.VALIDATE_ENV)}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "validate_commands.py")],
                       input=json.dumps(commands), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for flag, result in zip(cases, json.loads(r.stdout)):
        lines = (result["stdout"] + result["stderr"]).strip().splitlines()
        assert result["returncode"] == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"longctx: argument {flag}: 0 ") and "at least 1" in lines[0], lines


@pytest.mark.parametrize("flag, value", [("--slices", "x"), ("--chips-per-host", "two"),
                                         ("--max-restarts", "-1"), ("--slices", "0")])
def test_gke_jobset_says_a_bad_number_in_one_line(flag, value):
    spec = importlib.util.spec_from_file_location("gke_jobset", os.path.join(ROOT, "launch", "gke_jobset.py"))
    gke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gke)
    given = {"--slices": "2", "--topology": "4x4x4", "--image": "i", "--workdir": "gs://b/r", flag: value}
    err = io.StringIO()
    with redirect_stderr(err):
        status = gke.main([x for item in given.items() for x in item] + ["--dry-run"])
    lines = err.getvalue().strip().splitlines()
    assert status == 2 and len(lines) == 1 and flag in lines[0], lines


@pytest.mark.parametrize("script", sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "scripts", "*.py"))))
def test_a_script_run_without_the_venv_says_which_python_to_use(script):
    """`python scripts/x.py` with an interpreter that lacks jax (here this one without its
    site-packages, `-S`): one line naming .venv/bin/python, before any third-party import."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", cli.DEBUG_ENV)}
    r = ScriptServer.run([sys.executable, "-S", script, "--help"], cwd=ROOT, env=env,
                         timeout=60)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith("longctx: jax") and ".venv/bin/python" in lines[0], lines
