"""Test set-up: 8 virtual CPU devices, set before jax's CPU backend starts.

`jax_num_cpu_devices` is set through jax.config, not the environment, so the subprocesses tests
start (scripts, launch/local.py jobs) choose their own device count (LONGCTX_CPU_DEVICES).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# LLVM at optimisation level 0 instead of XLA's default 3 for the CPU programs the tests compile
# (here and, through the environment, in the scripts they start): the suite mostly compiles
# programs that run for a few steps. Against level 1, level 0 took 21% less CPU on
# tests/train/test_train.py, test_model_numerics.py and test_cp_training.py (201 -> 160 s) and less
# on every benchmark smoke test. The one program that runs long, the needle test's 200 training
# steps, took 38 s at level 0 against 26 at level 1, so it asks for level 1 itself
# (tests/evals/test_needle.py, through compiler_options). Without fast-math (off on
# XLA's CPU backend) LLVM keeps IEEE semantics at every level, so results do not change (the
# bitwise resume, sharding and bf16 tests pass under it). A level the caller set in XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

assert jax.device_count() == 8, f"tests expect 8 CPU devices, got {jax.device_count()}"
