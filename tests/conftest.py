"""Test set-up: 8 virtual CPU devices, forced before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)

assert jax.device_count() == 8, f"tests expect 8 CPU devices, got {jax.device_count()}"
