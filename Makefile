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

# Two pytest workers, one per core of this project's 2-core machines: compiling is mostly
# single-threaded. --dist loadfile keeps each file on one worker, so that a module's fixtures
# (tests/train/test_checkpoint.py's training runs, for one) run once; the files go out in the
# collection's order, the longest first (tests/conftest.py, LONGEST_FILES).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

clean:
	rm -rf runs $(VENV)
