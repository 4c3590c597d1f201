"""longctx's tests: one folder per package of longctx/ (tests/ops/ tests longctx/ops/, ...),
benchmarks/ for the benchmarks' smoke tests, and here the tests of the modules at longctx/'s top
(config, cli, the import graph), the docs' commands and links, and launch/. Shared helpers live
here too: child_env.py (a child script's environment), child_output.py, synthetic.py (packed
rows), stalled_save.py, validate_commands.py; fixtures/ and assets/ hold files the tests read."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
ASSETS = os.path.join(ROOT, "tests", "assets")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
