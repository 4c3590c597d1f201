"""Test set-up: 8 virtual CPU devices, set before jax's CPU backend starts; or, under
`pytest -m tpu` on a TPU host, the chip (tests/tpu/), and nothing else.

`jax_num_cpu_devices` is set through jax.config, not the environment, so the subprocesses tests
start (scripts, launch/local.py jobs) choose their own device count (LONGCTX_CPU_DEVICES).
"""

import os
import shutil
import sys
import tempfile

import pytest

# One persistent compilation cache for the whole session: the xdist workers and every script a
# test starts inherit it through the environment, so a program compiled once (the tiny model's
# train step, run by dozens of scripts/train.py children; the same jitted function rebuilt by
# another test) is read back instead of compiled again. The process that makes the directory (the
# xdist controller, or pytest alone) does so before any worker starts and removes it at the end,
# so each session starts empty and nothing compiled by an older checkout is ever read. Every
# program is kept, however fast its compile: most of the suite's are small (test_checkpoint.py,
# test_optimizer.py and test_hybrid.py together: 197 s without the cache, 148 s keeping every
# program, 185 s keeping those over jax's default of a second). No size limit: with one, jax
# takes a file lock and walks the whole directory on every write, which cost more than it saved.
# A reader that meets an entry another process is still writing fails to decompress it, and jax
# then warns and compiles. A cache the caller set up is used as it is.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="longctx-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from longctx.parallel import devices  # noqa: E402


def _chip_tier() -> bool:
    """Whether this session selects the chip's tier (`-m tpu`, read before pytest parses it:
    the backend must be chosen before jax starts)."""
    args = sys.argv[1:]
    return any(a == "tpu" and i > 0 and args[i - 1] == "-m" for i, a in enumerate(args)) or \
        "-mtpu" in args


CHIP_TIER = _chip_tier()
if not CHIP_TIER:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

# LLVM at optimisation level 0 instead of XLA's default 3 for the CPU programs the tests compile
# (here and, through the environment, in the scripts they start): the suite mostly compiles
# programs that run for a few steps. Against level 1, level 0 took 21% less CPU on
# tests/train/test_train.py, test_model_numerics.py and test_cp_training.py (201 -> 160 s) and less
# on every benchmark smoke test. The one program that runs long, the needle test's 200 training
# steps, took 38 s at level 0 against 26 at level 1, so it asks for level 1 itself
# (tests/evals/test_needle.py, through compiler_options). Without fast-math (off on
# XLA's CPU backend) LLVM keeps IEEE semantics at every level, so results do not change (the
# bitwise resume, sharding and bf16 tests pass under it).
# XLA:CPU's older elemental emitters instead of its fusion emitters, for the same reason: they
# compile the suite's programs faster (tests/train/test_train.py with test_model_numerics.py: 76 ->
# 62 s; three of test_context_parallel.py's cases: 16 -> 11 s), and the suite's bitwise tests
# (resume, sharding, accumulation) pass under them as under the fusion emitters. Either flag the
# caller set in XLA_FLAGS is kept.
os.environ["XLA_FLAGS"] = devices.with_default_flags(
    os.environ.get("XLA_FLAGS", ""),
    {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": "false"})

# XLA:CPU's collective timeouts raised as every script raises them (longctx.parallel.devices): the
# 8 virtual devices are 8 threads, and with both cores busy (two xdist workers and their children)
# one can reach a collective more than the default 40 s after the others, which XLA treats as a
# deadlock and aborts the whole process. Subprocesses inherit the flags.
os.environ["XLA_FLAGS"] = devices.with_cpu_collective_timeouts(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402

if not CHIP_TIER:
    jax.config.update("jax_num_cpu_devices", 8)
    assert jax.device_count() == 8, f"tests expect 8 CPU devices, got {jax.device_count()}"


# The files that take the most time, longest first (their share of a whole run's test time on
# 2026-12-07, compiled as above: 11.0% down to 1.2%). `make test` hands files to its two workers
# whole, in the order of the collection (--no-loadscope-reorder), and these go first, so that the
# run ends on short files: xdist's own order, files with the most tests first, left the one-test
# training files of a minute or more to the end, where one worker ran them while the other had
# nothing left. A file missing here, or one that has grown, only runs later; nothing depends on
# the order.
LONGEST_FILES = (
    "ops/test_ring_attention.py", "benchmarks/test_scripts_scale.py", "train/test_checkpoint.py",
    "train/test_train_safety.py", "evals/test_needle.py", "ops/test_context_parallel.py",
    "train/test_train.py", "model/test_attention_residuals.py", "plan/test_planner.py",
    "ops/test_splash_kernels.py", "ops/test_cp_tpu_aot.py", "train/test_multiprocess.py",
    "interop/test_families.py", "ops/test_per_document.py", "evals/test_ablate.py",
    "train/test_stop_signals.py", "plan/test_memory_breakdown.py",
    "data/test_data_multiprocess.py", "evals/test_ruler_learned.py", "test_cli_errors.py",
    "train/test_mixture_resume.py", "plan/test_strategy_memory.py", "model/test_block_options.py",
    "model/test_hybrid.py", "train/test_cp_training.py", "model/test_model.py",
    "evals/test_ruler_run.py", "train/test_lease.py", "plan/test_fit_remedy.py",
    "data/test_mixture_training.py")


def _file_rank(item) -> int:
    path = os.path.relpath(str(item.path), os.path.dirname(os.path.abspath(__file__)))
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES; a stable sort keeps each file's tests together and
    in order). The chip's tests run only under `-m tpu` on a TPU host; everywhere else they are
    skipped, so CI and `make test` stay green without one."""
    items.sort(key=_file_rank)
    on_chip = CHIP_TIER and jax.default_backend() == "tpu"
    reason = ("needs a TPU chip: run `pytest -m tpu tests/tpu` on a TPU host" if not CHIP_TIER
              else f"-m tpu on a {jax.default_backend()} host: there is no TPU here")
    for item in items:
        if item.get_closest_marker("tpu") is not None and not on_chip:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config):
    # A program compiled for a TPU topology (tests marked tpu_aot) is written to the cache, but
    # libtpu's compile-only client cannot read one back: jax warns and compiles it again.
    config.addinivalue_line("filterwarnings", "ignore:Error reading persistent compilation cache entry "
                            "for .*PjRtCompiler must be constructed with a Client:UserWarning")


def pytest_unconfigure(config):
    if _OWN_COMPILATION_CACHE is not None:
        shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)
