"""longctx's tests: one folder per package of longctx/ (tests/ops/ tests longctx/ops/, ...),
benchmarks/ for the benchmarks' smoke tests, and here the tests of the modules at longctx/'s top
(config, cli, the import graph), the docs' commands and links, and launch/. Shared helpers live
here too: child_env.py (a child script's environment), child_output.py, synthetic.py (packed
rows), stalled_save.py, validate_commands.py; fixtures/ and assets/ hold files the tests read."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
ASSETS = os.path.join(ROOT, "tests", "assets")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
# make test runs a covering subset; LONGCTX_EXHAUSTIVE=1 runs every case (README, "Two commands").
EXHAUSTIVE = bool(os.environ.get("LONGCTX_EXHAUSTIVE"))


def exhaustive_only(covered_by: str):
    """A mark for a case that runs only with LONGCTX_EXHAUSTIVE=1; `covered_by` names what
    checks the same code in the default subset."""
    import pytest
    return pytest.mark.skipif(not EXHAUSTIVE, reason=f"runs with LONGCTX_EXHAUSTIVE=1 ({covered_by})")
