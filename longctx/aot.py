"""Ahead-of-time compilation of the whole train step for a TPU topology, on any machine.

With libtpu installed, `jax.experimental.topologies` hands out abstract TPU devices for a named
topology ("v5p:4x4x4"); lowering and compiling the train step on a mesh of them runs the real TPU
compiler (Mosaic kernels included) here, and `memory_analysis()` says whether it fits in HBM.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

# libtpu takes a machine-wide lock file when it loads; a second process that only wants abstract
# topologies for ahead-of-time compiles (tests, estimate.py, another engineer's job) would fail
# with "Internal error when accessing libtpu multi-process lockfile". No TPU is opened here.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

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
    cores_per_chip: int = 1  # libtpu's v4 topologies give one device per TensorCore (2 per chip)
    oom_at_compile: bool = False  # the TPU compiler refused it: temporaries alone exceed HBM
    hlo: str | None = dataclasses.field(default=None, repr=False)  # compiled HLO (keep_hlo=True)

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def hbm_bytes(self) -> int | None:
        """HBM per device: the chip's, shared by its devices when each TensorCore is one."""
        chip = HBM_BYTES_BY_CHIP.get(self.device_kind)
        return None if chip is None else chip // self.cores_per_chip

    @property
    def fits(self) -> bool | None:
        if self.oom_at_compile:
            return False
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes


def _shard_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
    return total


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\).*?available HBM \(([\d.]+)([KMGT])\)", re.S)


_OOM_TOTAL = re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm")
_UNIT = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _oom_bytes(message: str, argument_bytes: int = 0):
    """(temporaries, available) bytes from the TPU compiler's out-of-memory message, or None.

    Two forms: "HLO temporaries (203.11G) exceeds available HBM (95.74G)" (temporaries alone),
    and "CompileTimeHbmOom ... Used 15.88G of 15.75G hbm" (everything: temporaries are the
    rest after the arguments)."""
    m = _OOM.search(message)
    if m:
        return (int(float(m.group(1)) * _UNIT[m.group(2)]),
                int(float(m.group(3)) * _UNIT[m.group(4)]))
    m = _OOM_TOTAL.search(message)
    if m:
        used = int(float(m.group(1)) * _UNIT[m.group(2)])
        return max(0, used - argument_bytes), int(float(m.group(3)) * _UNIT[m.group(4)])
    return None


def compile_train_step(config: ml_collections.ConfigDict, topology: str | None = None, *,
                       devices=None, keep_hlo: bool = False) -> CompiledStep:
    """Compiles one train step of `config` for `topology` and reports per-device memory.

    `devices` instead of a topology compiles for given (e.g. local CPU) devices. When the TPU
    compiler itself refuses the program for lack of HBM (it does so when the temporaries alone
    exceed the chip), the result carries the temporaries it reported and `oom_at_compile=True`;
    arguments and outputs are then the per-device shard sizes of the state and batch.
    """
    if devices is None:
        devices = topology_devices(topology)
    devices = list(devices)
    topology = topology or f"{devices[0].platform}:{len(devices)}"
    sizes = config_lib.validate(config, num_devices=len(devices))
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    layout = train.resolve_layout(config, sizes[mesh_lib.SP])
    # make_setup builds a concrete PRNG key; under set_mesh of abstract TPU devices that would
    # try to run on them. Its shardings name the mesh explicitly, so it needs no mesh context.
    with jax.default_device(jax.devices("cpu")[0]):
        setup = train.make_setup(config, mesh, layout)
    common = dict(topology=topology, device_kind=devices[0].device_kind,
                  num_devices=len(devices), mesh_shape=dict(mesh.shape),
                  cores_per_chip=cores_per_chip(devices))
    with jax.set_mesh(mesh):
        train_step, _ = train.jit_steps(config, setup)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             setup.abstract_state, setup.state_shardings)
        shape = (config.data.global_batch_size, config.data.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=setup.batch_sharding)
                 for k in train.BATCH_KEYS}
        start = time.perf_counter()
        lowered = train_step.lower(state, batch)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            state_bytes = _shard_bytes(state)
            oom = (_oom_bytes(str(e), state_bytes + _shard_bytes(batch))
                   if "RESOURCE_EXHAUSTED" in str(e) else None)
            if oom is None:
                raise
            return CompiledStep(**common, argument_bytes=state_bytes + _shard_bytes(batch),
                                output_bytes=state_bytes, alias_bytes=state_bytes,
                                temp_bytes=oom[0], compile_seconds=time.perf_counter() - start,
                                oom_at_compile=True)
        seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return CompiledStep(
        **common, argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes, compile_seconds=seconds,
        hlo=compiled.as_text() if keep_hlo else None)


def cores_per_chip(devices) -> int:
    chips = {tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)}
    return max(1, len(devices) // len(chips))


def per_device_batch(config, mesh_shape: dict) -> int:
    return config.data.global_batch_size // (mesh_shape[mesh_lib.DP] * mesh_shape[mesh_lib.FSDP]
                                             * config.mesh.dcn_dp * config.mesh.dcn_fsdp)


def suggest_remedies(config: ml_collections.ConfigDict, result: CompiledStep) -> list[str]:
    """Overrides that should bring a step that does not fit under HBM, most effective first.

    A first-order model of the compiled numbers: arguments (parameters + optimizer state) shrink
    with fsdp; temporaries (activations) grow with per-device tokens = batch/(dp*fsdp) * seq/sp.
    Each line names the override and the estimated per-device total; verify with estimate.py.
    """
    hbm = result.hbm_bytes
    if hbm is None or result.fits:
        return []
    shape = result.mesh_shape
    dp, fsdp, sp = shape[mesh_lib.DP], shape[mesh_lib.FSDP], shape[mesh_lib.SP]
    args = result.argument_bytes
    temp = result.temp_bytes + result.output_bytes - result.alias_bytes
    est = []
    policy = config.model.remat_policy
    if policy != "nothing_saveable":
        # Saved per-layer activations dominate temporaries without full remat; nothing_saveable
        # keeps only each layer's input. Rough factor from Llama-shaped blocks: ~1/4.
        est.append((f"--config.model.remat_policy=nothing_saveable (now {policy!r})", args + temp / 4))
    # Larger sp at the same chip count: per-device tokens halve, fsdp halves (arguments double).
    if fsdp % 2 == 0 and config.data.seq_len % (2 * sp * config.attention.block_size) == 0:
        est.append((f"--config.mesh.sp={2 * sp} --config.mesh.fsdp={fsdp // 2} (ring over {2 * sp} chips)",
                    args * 2 + temp / 2))
    elif dp % 2 == 0 and config.data.seq_len % (2 * sp * config.attention.block_size) == 0:
        est.append((f"--config.mesh.sp={2 * sp} --config.mesh.dp={dp // 2}", args + temp / 2))
    b = per_device_batch(config, shape)
    if b > 1:
        est.append((f"--config.data.global_batch_size={config.data.global_batch_size // 2} "
                    f"(per-device batch {b} -> {b // 2})", args + temp / 2))
    est.append((f"a topology with 2x the chips and --config.mesh.sp={2 * sp} (same per-chip "
                "parameters, half the tokens per chip)", args + temp / 2))
    if config.data.seq_len >= 2 * sp * config.attention.block_size:
        est.append((f"--config.data.seq_len={config.data.seq_len // 2}", args + temp / 2))
    lines = []
    for text, total in sorted(est, key=lambda e: e[1]):
        verdict = "fits" if total <= hbm else "still over"
        lines.append(f"{text}: ~{total / GIB:.1f} GiB per chip, {verdict} (estimate)")
    return lines


def format_report(config, result: CompiledStep) -> str:
    """The human-readable memory report estimate.py prints."""
    g = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    shape = " x ".join(f"{k}={v}" for k, v in result.mesh_shape.items())
    lines = [
        f"topology   {result.topology} ({result.num_devices} x {result.device_kind}), mesh {shape}",
        f"sequence   {config.data.seq_len} tokens x batch {config.data.global_batch_size} "
        f"({config.data.seq_len // result.mesh_shape[mesh_lib.SP]} tokens per chip on the ring), "
        f"attention {config.attention.impl}, remat {config.model.remat_policy}",
        (f"compiled   in {result.compile_seconds:.1f}s" if not result.oom_at_compile else
         f"compiler   refused it after {result.compile_seconds:.1f}s: out of HBM (temporaries below "
         "are the compiler's figure; arguments/outputs are the state and batch shards)"),
        "per-device memory:",
        f"  arguments    {g(result.argument_bytes)}   (parameters, optimizer state, batch)",
        f"  outputs      {g(result.output_bytes)}   ({result.alias_bytes / GIB:.2f} GiB of them "
        "aliased to donated arguments)",
        f"  temporaries  {g(result.temp_bytes)}",
        f"  total        {g(result.total_bytes)}",
    ]
    if result.hbm_bytes is None:
        lines.append(f"chip HBM     unknown for {result.device_kind!r}: cannot say whether it fits")
        return "\n".join(lines)
    lines.append(f"chip HBM     {g(result.hbm_bytes)}")
    pct = 100 * result.total_bytes / result.hbm_bytes
    lines.append(f"fits         {'yes' if result.fits else 'NO'} ({pct:.0f}% of HBM)")
    remedies = suggest_remedies(config, result)
    if remedies:
        lines.append("suggested remedies (first-order estimates, most effective first):")
        lines += [f"  {r}" for r in remedies]
    return "\n".join(lines)
