"""Ahead-of-time compilation of the whole train step for a TPU topology, on any machine.

With libtpu installed, `jax.experimental.topologies` hands out abstract TPU devices for a named
topology ("v5p:4x4x4"); lowering and compiling the train step on a mesh of them runs the real TPU
compiler (Mosaic kernels included) here, and `memory_analysis()` says whether it fits in HBM.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
from jax.experimental import topologies

from longctx import config as config_lib
from longctx import mesh as mesh_lib
from longctx import train

GIB = 1024 ** 3

# HBM per chip (bytes) by the device_kind libtpu reports.
HBM_BYTES_BY_CHIP = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,
    "TPU v5e": 16 * GIB,
    "TPU v5": 95 * GIB,
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,
    "TPU v6e": 32 * GIB,
}


def libtpu_available() -> bool:
    try:
        topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
        return True
    except Exception:  # noqa: BLE001  (no libtpu, or one that cannot describe topologies)
        return False


def topology_devices(topology: str) -> list:
    """Abstract TPU devices for e.g. "v5p:2x2x2" (libtpu names: v4, v5e, v5p, v6e)."""
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"topology {topology!r} is not known to libtpu ({str(e).splitlines()[0][:200]}).") from None


@dataclasses.dataclass
class CompiledStep:
    topology: str
    device_kind: str
    num_devices: int
    mesh_shape: dict
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # donated state: counted in both arguments and outputs, held once
    compile_seconds: float

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def hbm_bytes(self) -> int | None:
        return HBM_BYTES_BY_CHIP.get(self.device_kind)

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes


def compile_train_step(config: ml_collections.ConfigDict, topology: str) -> CompiledStep:
    """Compiles one train step of `config` for `topology` and reports per-device memory."""
    devices = topology_devices(topology)
    sizes = config_lib.validate(config, num_devices=len(devices))
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    layout = train.resolve_layout(config, sizes[mesh_lib.SP])
    with jax.set_mesh(mesh):
        setup = train.make_setup(config, mesh, layout)
        train_step, _ = train.jit_steps(config, setup)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             setup.abstract_state, setup.state_shardings)
        shape = (config.data.global_batch_size, config.data.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=setup.batch_sharding)
                 for k in train.BATCH_KEYS}
        start = time.perf_counter()
        compiled = train_step.lower(state, batch).compile()
        seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return CompiledStep(
        topology=topology, device_kind=devices[0].device_kind, num_devices=len(devices),
        mesh_shape=dict(mesh.shape), argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes, compile_seconds=seconds)
