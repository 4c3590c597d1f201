"""XLA:CPU's collective timeouts, raised wherever longctx sets up virtual CPU devices.

N virtual CPU devices are N threads of one process; XLA aborts the whole process (SIGABRT,
"Termination timeout for all reduce RendezvousKey ... of 40 seconds exceeded") when one reaches a
collective 40 s after the others, which on a busy 2-core host is a starved thread, not a deadlock.
`longctx.parallel.devices.with_cpu_collective_timeouts` raises both of XLA's waits, keeping what the
user set; the bootstrap of every script (`configure_cpu_devices`), the tests' conftest and
launch/local.py's children use it.

The mechanism is checked for real on a program whose device 0 reaches a psum late (an io_callback
that sleeps on it): XLA honours the flags by name, a timeout the user set is kept (and aborts as
XLA's own would), and with LONGCTX_EXHAUSTIVE=1 a device 45 s late (past XLA's default 40 s) and
a soak (a 4-step tiny run on 8 devices beside four busy loops, 10 runs) pass.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from longctx.parallel import devices
from tests import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TERMINATE = "xla_cpu_collective_call_terminate_timeout_seconds"
WARN = "xla_cpu_collective_call_warn_stuck_timeout_seconds"
XLA_DEFAULT_TERMINATE_S = 40

# Device 0 of 4 reaches an all-reduce argv[1] seconds after the other three.
LATE_DEVICE = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import io_callback
    from jax.sharding import Mesh, PartitionSpec as P

    def wait_on_device_0(index):
        if int(index) == 0:
            time.sleep(float(sys.argv[1]))
        return np.int32(0)

    def late_sum(x):
        late = io_callback(wait_on_device_0, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("x"))
        return jax.lax.psum(x + late, "x")

    mesh = Mesh(np.array(jax.devices()), ("x",))
    total = jax.jit(jax.shard_map(late_sum, mesh=mesh, in_specs=P("x"), out_specs=P()))(jnp.ones(4, jnp.int32))
    print("sum", int(total[0]))
""")


def _run_late_device(seconds: float, xla_flags: str) -> subprocess.CompletedProcess:
    env = child_env.script_env(JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    return subprocess.run([sys.executable, "-c", LATE_DEVICE, str(seconds)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_both_timeouts_are_added_past_xla_s_default_and_the_user_s_flags_are_kept():
    assert devices.CPU_COLLECTIVE_TIMEOUTS[TERMINATE] > XLA_DEFAULT_TERMINATE_S
    assert set(devices.CPU_COLLECTIVE_TIMEOUTS) == {TERMINATE, WARN}
    assert devices.with_cpu_collective_timeouts("") == f"--{WARN}=300 --{TERMINATE}=1200"
    user = f"--xla_backend_optimization_level=0 --{TERMINATE}=7"
    flags = devices.with_cpu_collective_timeouts(user)
    assert flags == f"{user} --{WARN}=300"  # the user's timeout stays, once
    assert devices.with_cpu_collective_timeouts(flags) == flags


def test_a_default_flag_is_added_only_where_xla_flags_do_not_set_it():
    defaults = {"xla_cpu_use_fusion_emitters": "false", "xla_backend_optimization_level": 0}
    assert devices.with_default_flags("", defaults) == ("--xla_cpu_use_fusion_emitters=false "
                                                        "--xla_backend_optimization_level=0")
    user = "--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters_extra=1"
    # the user's level stays; a longer flag name that starts with a default's is not that flag
    assert devices.with_default_flags(user, defaults) == f"{user} --xla_cpu_use_fusion_emitters=false"


def test_every_place_that_sets_up_cpu_devices_raises_them():
    user = "--xla_dump_to=/tmp/x"
    # this test process (tests/conftest.py), and through it every script a test starts
    assert f"--{TERMINATE}=" in os.environ["XLA_FLAGS"] and f"--{WARN}=" in os.environ["XLA_FLAGS"]
    # every script's bootstrap (in a process of its own: it sets the environment before jax starts)
    bootstrap = subprocess.run(
        [sys.executable, "-c", "import os; from longctx.parallel import devices; "
         "devices.configure_cpu_devices(); print(os.environ['XLA_FLAGS'])"],
        env=child_env.script_env(XLA_FLAGS=user), capture_output=True, text=True, timeout=60)
    assert bootstrap.stdout.strip() == devices.with_cpu_collective_timeouts(user), bootstrap.stderr
    # launch/local.py's children
    spec = importlib.util.spec_from_file_location("local_launcher", os.path.join(ROOT, "launch", "local.py"))
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    env = local.child_env({"XLA_FLAGS": user}, 1234, 2, 1, 4)
    assert env["XLA_FLAGS"] == devices.with_cpu_collective_timeouts(user)


def test_xla_honours_the_flags_by_name_and_a_user_s_short_timeout_still_aborts():
    """A device 4 s late: fine under longctx's flags; under a user's 1-second terminate timeout
    (kept by `with_cpu_collective_timeouts`) XLA aborts as it would at its own 40 s, which shows the
    flags are read by these names (an unknown name in XLA_FLAGS is a fatal error, too)."""
    ok = _run_late_device(4, devices.with_cpu_collective_timeouts(""))
    assert ok.returncode == 0 and "sum 4" in ok.stdout, ok.stderr[-2000:]
    short = _run_late_device(4, devices.with_cpu_collective_timeouts(f"--{TERMINATE}=1 --{WARN}=1"))
    assert short.returncode == -6 or short.returncode == 134, short.returncode
    assert "Termination timeout" in short.stderr and "sum" not in short.stdout


exhaustive = pytest.mark.skipif(not os.environ.get("LONGCTX_EXHAUSTIVE"),
                                reason="minutes of wall time: runs with LONGCTX_EXHAUSTIVE=1")


@exhaustive
def test_a_device_later_than_xla_s_default_timeout_does_not_abort():
    late = _run_late_device(XLA_DEFAULT_TERMINATE_S + 5, devices.with_cpu_collective_timeouts(""))
    assert late.returncode == 0 and "sum 4" in late.stdout, late.stderr[-2000:]


@exhaustive
@pytest.mark.parametrize("attempt", range(10))
def test_a_tiny_run_on_8_devices_beside_four_busy_loops_does_not_abort(tmp_path, attempt):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        r = subprocess.run([sys.executable, "scripts/train.py", "--config=configs/base.py:tiny",
                            f"--workdir={tmp_path / 'run'}", "--config.train.num_steps=4",
                            "--config.train.eval_every=0", "--config.checkpoint.every_steps=4"],
                           cwd=ROOT, env=child_env.script_env(LONGCTX_CPU_DEVICES="8"),
                           capture_output=True, text=True, timeout=1800)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "Termination timeout" not in r.stderr
