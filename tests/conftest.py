"""Test set-up: 8 virtual CPU devices, set before jax's CPU backend starts.

`jax_num_cpu_devices` is set through jax.config, not the environment, so the subprocesses tests
start (scripts, launch/local.py jobs) choose their own device count (LONGCTX_CPU_DEVICES).
"""

import os

from longctx.parallel import devices

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

# XLA:CPU's collective timeouts raised as every script raises them (longctx.parallel.devices): the
# 8 virtual devices are 8 threads, and with both cores busy (two xdist workers and their children)
# one can reach a collective more than the default 40 s after the others, which XLA treats as a
# deadlock and aborts the whole process. Subprocesses inherit the flags.
os.environ["XLA_FLAGS"] = devices.with_cpu_collective_timeouts(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

assert jax.device_count() == 8, f"tests expect 8 CPU devices, got {jax.device_count()}"
