"""Test set-up: 8 virtual CPU devices, set before jax's CPU backend starts.

`jax_num_cpu_devices` is set through jax.config, not the environment, so the subprocesses tests
start (scripts, launch/local.py jobs) choose their own device count (LONGCTX_CPU_DEVICES).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

assert jax.device_count() == 8, f"tests expect 8 CPU devices, got {jax.device_count()}"
