"""Small host values exchanged among the processes of a job: the agreements (a start-up check, a
stop request, a save's outcome, the workdir lease) that every process must reach before any goes on.

Why not `jax.experimental.multihost_utils.process_allgather`: it reads the gathered result from
this host's first device only, so it can return while the same collective is still running on
the host's other devices (on CPU, still connecting gloo pairs to the other processes). A process
that exits right after (the usual next step when an agreement fails) then hangs in the CPU
client's destructor, waiting on a connection to a peer that has already exited: seen in about one
start-up failure in 25 with both cores busy, for 150 s each time. `allgather` (and `replicated`,
for a global array) returns only after the collective has finished on every local device.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _identity(x):
    return x


def allgather(value: np.ndarray) -> np.ndarray:
    """Every process's `value` (same shape and dtype on all), stacked in process order:
    [process_count, *value.shape], on every process."""
    value = np.asarray(value)
    if jax.process_count() == 1:
        return value[None]
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("processes", "local_devices"))
    rows = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("processes")), value[None])
    return replicated(rows)


def replicated(array: jax.Array) -> np.ndarray:
    """The whole value of a global array (NamedSharding) on every process."""
    whole = jax.jit(_identity, out_shardings=NamedSharding(array.sharding.mesh, PartitionSpec()))(array)
    whole.block_until_ready()  # every local device's copy, not only the first (see above)
    return np.asarray(whole.addressable_data(0))
