"""Process start-up for CPU runs: virtual devices and platform choice, before jax is imported.

Entry points (scripts, launch/local.py children) call `configure_cpu_devices()` first thing. On a
machine with a TPU or GPU nothing changes; on a CPU-only machine the host is split into
`LONGCTX_CPU_DEVICES` (default 8) virtual devices so that (dp, fsdp, sp) meshes can be exercised.
"""

import os
import sys


def configure_cpu_devices(default: int = 8) -> None:
    if "jax" in sys.modules:
        raise RuntimeError("longctx.platform.configure_cpu_devices() must run before jax is imported.")
    count = int(os.environ.get("LONGCTX_CPU_DEVICES", default))
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if not _has_accelerator():
        # libtpu is installed for ahead-of-time TPU compiles; without a TPU, skip its probing.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _has_accelerator() -> bool:
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"] != "cpu"
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio") or os.path.exists("/dev/nvidia0")
