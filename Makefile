# The two commands a newcomer needs: `make demo` and `make test`.
# Benchmarks are not run here: benchmarks/bench_*.py, each writing its figures into docs/
# (index: docs/benchmarks.md); the user commands are in scripts/.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,tpu]'
	touch $(STAMP)

setup: $(STAMP)

# A real training run of the tiny model on the embedded standard-library corpus,
# across 8 virtual CPU devices with a (dp, fsdp, sp) = (1, 2, 4) mesh.
demo: $(STAMP)
	$(PY) scripts/train.py --config=configs/base.py:tiny --workdir=runs/demo

# Two pytest workers, one per core here: compiling is mostly single-threaded. A fresh clone's
# `make test` has taken 9:29, 17:22 and 28:08 on three 2-core machines (about 50 CPU-minutes on
# the slowest); one worker took 14-15 minutes on the first, with fewer tests. With issue 36's
# tests (735) it took 18:09 and 19:04 on this project's 2-core machine (12-03, 34 CPU-minutes).
# After issue 37's re-layout (769 tests), a fresh clone's `make test` took 20:02 with set-up
# (19:10 in pytest, 35 CPU-minutes), over the 15 minutes it should take: see issue 37's note.
# With issue 38's strategies and issue 40's packer (844 tests) a fresh clone's took 21:41 with
# set-up (20:45 in pytest, 38 CPU-minutes user), still over. With every test program compiled at LLVM
# level 0 (tests/conftest.py) and the rings' and policies' products opt-in (LONGCTX_EXHAUSTIVE=1), a
# fresh clone's took 14:40 with set-up (14:03 in pytest, 28 CPU-minutes: 1,538 s user + 125 s sys),
# 867 tests, on 12-04: under the 15 minutes, with little to spare. Later on 12-04 (873 tests), two fresh
# clones 40 minutes apart took 13:27 and 15:10 with set-up (12:58 and 14:38 in pytest): the same tests,
# 13% more CPU in the second; this shared machine's speed moves by that much. On 12-05, with issue 54,
# hybrid attention, the halo strategy, RULER and data mixtures (1,179 tests), a fresh clone took 16:16
# with set-up (15:37 in pytest, 30 CPU-minutes user), 1,148 passed, 31 skipped. Later on 12-05, with
# the model families, the planner per layer type and TPU7x (1,329 tests), one took 19:38 with set-up
# (18:51 in pytest, 36 CPU-minutes user), 1,285 passed, 44 skipped: under 20 minutes, with little to spare.
# --dist loadfile keeps each file on one worker, so that a module's fixtures
# (tests/train/test_checkpoint.py's training runs, for one) run once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf runs $(VENV)
