"""Process start-up for CPU runs: how many virtual CPU devices, and which platform, before jax starts.

Entry points (scripts, launch/local.py children) call `configure_cpu_devices()` first thing (it is
also `longctx.cli.configure_cpu_devices`). On a machine with a TPU or GPU nothing changes but the
CPU backend's device count; on a CPU-only machine the host is split into N virtual devices so that
(dp, fsdp, sp) meshes can be exercised, where N is, first found:

  LONGCTX_CPU_DEVICES   the user-facing knob (launch/local.py sets it per child)
  JAX_NUM_CPU_DEVICES   jax's own setting, if the user set it
  `default`             8 unless the script asks for more

N goes to jax as `JAX_NUM_CPU_DEVICES` (jax's `jax_num_cpu_devices` option, which takes precedence
over `--xla_force_host_platform_device_count` in `XLA_FLAGS`).

`XLA_FLAGS` gets longer CPU collective timeouts (`with_cpu_collective_timeouts`), keeping every flag
the user set: the N virtual devices are N threads of one process, and XLA:CPU aborts the process
(SIGABRT, "Termination timeout for all reduce RendezvousKey ... of 40 seconds exceeded") when one
of them reaches a collective 40 s after the others. On a busy host that is a starved thread, not
a deadlock: with both cores of a 2-core machine oversubscribed, a tiny model's step on 8 devices
died so. The tests (tests/conftest.py) and launch/local.py's children get the same flags.
"""

from __future__ import annotations

import os
import re
import sys

from longctx.errors import ConfigError

ENV = "LONGCTX_CPU_DEVICES"
JAX_ENV = "JAX_NUM_CPU_DEVICES"

# XLA:CPU's waits at a collective's rendezvous, raised from its defaults (warn after 20 s, abort
# after 40 s): a device thread starved for minutes on a loaded host is slow, not stuck. A real
# deadlock still ends, after 20 minutes, with XLA's own message.
CPU_COLLECTIVE_TIMEOUTS = {
    "xla_cpu_collective_call_warn_stuck_timeout_seconds": 300,
    "xla_cpu_collective_call_terminate_timeout_seconds": 1200,
}


def cpu_device_count(default: int = 8) -> int:
    """The number of virtual CPU devices this process asks for (see the module docstring)."""
    for name in (ENV, JAX_ENV):
        text = os.environ.get(name, "").strip()
        if text:
            try:
                count = int(text)
            except ValueError:
                count = 0
            if count < 1:
                raise ConfigError(f"{name}={text!r} must be a positive number of CPU devices.")
            return count
    return default


def configure_cpu_devices(default: int = 8) -> int:
    """Sets the CPU device count (and JAX_PLATFORMS=cpu without an accelerator); returns the count.

    Must run before jax's backends start: best before jax is imported (through the environment);
    if jax is already imported, through `jax.config` (RuntimeError once a backend is running).
    """
    count = cpu_device_count(default)
    os.environ[JAX_ENV] = str(count)
    os.environ["XLA_FLAGS"] = with_cpu_collective_timeouts(os.environ.get("XLA_FLAGS", ""))
    if not has_accelerator():
        # libtpu is installed for ahead-of-time TPU compiles; without a TPU, skip its probing.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules:  # the environment has been read already; tell jax directly
        import jax  # lazily: this runs before jax is imported, unless it already was

        try:
            jax.config.update("jax_num_cpu_devices", count)
            if os.environ.get("JAX_PLATFORMS"):
                jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
        except RuntimeError as e:
            raise RuntimeError("longctx.parallel.devices.configure_cpu_devices() must run before any jax "
                               f"computation starts a backend ({e}).") from None
    return count


def with_default_flags(xla_flags: str, defaults: dict) -> str:
    """`xla_flags` (an XLA_FLAGS value) with each flag of `defaults` ({name: value}) added that
    it does not set; a flag already set there is kept as the user set it. XLA reads XLA_FLAGS
    when its first backend starts."""
    added = [f"--{name}={value}" for name, value in defaults.items()
             if not re.search(rf"--{name}\b", xla_flags)]
    return " ".join([xla_flags.strip(), *added]).strip()


def with_cpu_collective_timeouts(xla_flags: str) -> str:
    """`xla_flags` with CPU_COLLECTIVE_TIMEOUTS added where it sets none (`with_default_flags`)."""
    return with_default_flags(xla_flags, CPU_COLLECTIVE_TIMEOUTS)


def has_accelerator() -> bool:
    """Whether this machine has a TPU or GPU jax may use (JAX_PLATFORMS, when set, decides)."""
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"] != "cpu"
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio") or os.path.exists("/dev/nvidia0")
