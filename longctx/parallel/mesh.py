"""The device mesh: distributed start-up, the (dp, fsdp, sp) mesh, and logical-axis sharding rules.

Model code names the axes of every parameter and activation with *logical* names ("embed",
"heads", "activation_batch", ...). `LOGICAL_RULES` maps each logical name to mesh axes, and
`logical_to_spec` turns a tuple of logical names into a `PartitionSpec`. This is the only module
that knows which mesh axis shards what.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from longctx import errors

# Mesh axis names: data parallel, fully-sharded data parallel, sequence parallel (the ring).
DP, FSDP, SP = "dp", "fsdp", "sp"
MESH_AXES = (DP, FSDP, SP)
BATCH_AXES = (DP, FSDP)  # the batch is split over every data-parallel axis

# Parameters (and their gradients and optimizer state) are sharded over every axis whose devices
# hold different tokens but want the same weights: fsdp and the sp ring. A ring of 16 chips then
# holds 1/16 of the weights each instead of a full copy, and each layer's weights are gathered
# inside the layer scan just before use (`gathered_spec`), as FSDP does over fsdp alone. dp keeps
# full copies (cheap gradients all-reduce across slices); `optimizer_rules(over_dp=True)` shards
# the optimizer state over it too, ZeRO-1 style.
PARAM_AXES = (FSDP, SP)

# Logical axis -> mesh axes (None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters: the model dimension of every weight (and norm scale) is split over PARAM_AXES
    "vocab": None,
    "embed": PARAM_AXES,
    "mlp": None,
    "heads": None,
    "kv_heads": None,
    "head_dim": None,
    "layers": None,
    "norm": PARAM_AXES,
    # activations
    "activation_batch": BATCH_AXES,
    "activation_length": SP,
    "activation_embed": None,
    "activation_heads": None,
    "activation_kv_heads": None,
    "activation_head_dim": None,
    "activation_vocab": None,
    "activation_mlp": None,
}

Rules = dict[str, "str | tuple[str, ...] | None"]


def optimizer_rules(over_dp: bool) -> Rules:
    """The rules for optimizer state: the parameters' own, or with dp added in front of every
    parameter-sharding axis (ZeRO-1: each dp replica updates its slice, then the new parameters
    are gathered over dp)."""
    if not over_dp:
        return LOGICAL_RULES
    return {name: (DP, *PARAM_AXES) if axes == PARAM_AXES else axes
            for name, axes in LOGICAL_RULES.items()}


def _as_tuple(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits over, in order (P(None, ("fsdp", "sp")) -> fsdp, sp)."""
    return tuple(axis for entry in spec for axis in _as_tuple(entry or ()))


def split_axes(logical_axis: str, over_dp: bool = False) -> tuple[str, ...]:
    """The mesh axes a parameter's `logical_axis` (or, with over_dp, its optimizer state's) is
    split over: the dimension must divide by the product of their sizes."""
    return _as_tuple(optimizer_rules(over_dp)[logical_axis] or ())


def logical_to_spec(logical_axes: Sequence[str | None] | None, rules: Rules | None = None) -> PartitionSpec:
    """PartitionSpec for a tuple of logical axis names, by `rules` (default `LOGICAL_RULES`)."""
    rules = LOGICAL_RULES if rules is None else rules
    if logical_axes is None:
        return PartitionSpec()
    specs = []
    for name in logical_axes:
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule in longctx.parallel.mesh.LOGICAL_RULES.")
        specs.append(None if name is None else rules[name])
    return PartitionSpec(*specs)


def embedding_lookup_reshards() -> tuple[PartitionSpec, ...]:
    """The shardings a [batch, length, embed] embedding lookup goes through, in order.

    A lookup in a table split over PARAM_AXES along embed comes out split the same way (every
    device reads its columns for every token); the activation wants batch over BATCH_AXES and
    length over SP. XLA cannot make that move in one step and falls back to replicating the whole
    activation ("involuntary full rematerialization"), so it moves one mesh axis at a time: fsdp
    from embed to batch (an all-to-all over fsdp; dp only slices), then sp from embed to length
    (an all-to-all over sp)."""
    return (PartitionSpec(BATCH_AXES, None, SP), logical_to_spec(("activation_batch", "activation_length",
                                                                 "activation_embed")))


def gathered_spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    """Where a parameter lives while a layer computes with it: its sharding with the data-like axes
    (dp, fsdp, sp) taken out, i.e. gathered over them; any model-parallel split would stay."""
    spec = logical_to_spec(logical_axes)
    kept = []
    for axes in spec:
        rest = tuple(a for a in _as_tuple(axes or ()) if a not in MESH_AXES)
        kept.append(rest or None)
    return PartitionSpec(*kept)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None] | None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, seq] arrays: batch over (dp, fsdp), sequence over the sp ring."""
    return logical_sharding(mesh, ("activation_batch", "activation_length"))


def maybe_initialize_distributed(dist_config) -> None:
    """Starts jax.distributed when this run has several processes.

    Explicit coordinator settings (or the LONGCTX_COORDINATOR/... environment that launch/local.py
    sets) start a loopback or cluster job. On TPU, `tpu_worker_hosts` says how many hosts the
    slice has: several (a pod), or a multi-slice job (MEGASCALE_COORDINATOR_ADDRESS), and
    jax.distributed auto-detects everything; one host is one process and needs no jax.distributed
    (its auto-detection asks the metadata server for the pod's hosts, which a single TPU VM
    without one, TPU_SKIP_MDS_QUERY=true, does not answer). A single process on CPU skips it.
    A start that fails says in one sentence which variable sets what it could not find.
    """
    if jax.distributed.is_initialized():
        return
    address = dist_config.coordinator_address or os.environ.get("LONGCTX_COORDINATOR", "")
    num_processes = dist_config.num_processes or int(os.environ.get("LONGCTX_NUM_PROCESSES", "0"))
    process_id = dist_config.process_id
    if process_id < 0:
        process_id = int(os.environ.get("LONGCTX_PROCESS_ID", "-1"))
    if address:
        if num_processes <= 0 or process_id < 0:
            raise ValueError(
                "distributed.coordinator_address is set, so distributed.num_processes and "
                "distributed.process_id must be set too."
            )
        # Cross-process collectives on CPU need an implementation; gloo ships with jaxlib. This
        # only affects the CPU client, and must not ask which backend is in use: that would start
        # the backend before jax.distributed.initialize, which then refuses to run.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        local = dist_config.local_device_count or None
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=list(range(local)) if local else None,
        )
        return
    hosts = tpu_worker_hosts()
    multi_slice = bool(os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))
    if len(hosts) <= 1 and not multi_slice:
        return  # one host: one process (or a CPU run)
    try:
        jax.distributed.initialize()  # TPU pod or multi-slice: everything is auto-detected
    except Exception as e:  # noqa: BLE001  (whatever auto-detection raised: said in one sentence)
        what = (f"TPU_WORKER_HOSTNAMES names {len(hosts)} hosts ({', '.join(hosts[:3])}"
                f"{', ...' if len(hosts) > 3 else ''})" if len(hosts) > 1
                else "MEGASCALE_COORDINATOR_ADDRESS is set")
        raise errors.ConfigError(
            f"jax.distributed could not start ({errors.first_line(e)}); it was started because {what}: "
            "on a single host unset it (or set TPU_WORKER_HOSTNAMES=localhost), and on several hosts "
            "whose coordinator cannot be found set LONGCTX_COORDINATOR=HOST:PORT with "
            "LONGCTX_NUM_PROCESSES and LONGCTX_PROCESS_ID on every host.") from None


def tpu_worker_hosts() -> list[str]:
    """The hosts TPU_WORKER_HOSTNAMES names (comma-separated; a TPU VM and GKE set it), [] if unset."""
    return [h.strip() for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]


def resolve_mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
    """Within-slice (dp, fsdp, sp) sizes with the single -1 filled in; raises on a bad fit."""
    dcn = {a: int(mesh_config[f"dcn_{a}"]) for a in MESH_AXES}
    num_slices = math.prod(dcn.values())
    if num_devices % num_slices:
        raise ValueError(
            f"mesh: {num_devices} devices cannot be split into {num_slices} slices "
            f"(dcn_dp*dcn_fsdp*dcn_sp = {num_slices})."
        )
    per_slice = num_devices // num_slices
    sizes = {a: int(mesh_config[a]) for a in MESH_AXES}
    unknown = [a for a, s in sizes.items() if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {unknown}.")
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise ValueError(f"mesh.{bad[0]}={sizes[bad[0]]} must be a positive size or -1.")
    known = math.prod(s for s in sizes.values() if s != -1)
    if unknown:
        if per_slice % known:
            raise ValueError(
                f"mesh: {per_slice} devices per slice are not divisible by the fixed axes "
                f"({' x '.join(f'{a}={s}' for a, s in sizes.items() if s != -1)} = {known})."
            )
        sizes[unknown[0]] = per_slice // known
    elif known != per_slice:
        where = f"the {per_slice} devices" + (" per slice" if num_slices > 1 else "")
        raise ValueError(
            f"mesh: dp*fsdp*sp = {sizes[DP]}*{sizes[FSDP]}*{sizes[SP]} = {known} does not match "
            f"{where}{_mesh_fix(sizes, per_slice)}."
        )
    return sizes


def _mesh_fix(sizes: dict[str, int], per_slice: int) -> str:
    """": set --config.mesh.<axis>=<n>" for the axes that alone can make the mesh fit, the ring
    (sp, usually the size the user chose on purpose) last; "" when no single axis can."""
    fixes = []
    for axis in (DP, FSDP, SP):
        others = math.prod(s for a, s in sizes.items() if a != axis)
        if per_slice % others == 0:
            fixes.append(f"--config.mesh.{axis}={per_slice // others}")
    if not fixes:
        return ""
    return f": set {fixes[0]}" + (f" (or {' or '.join(fixes[1:])})" if fixes[1:] else "")


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (dp, fsdp, sp) mesh; multi-slice via DCN sizes when any dcn_* > 1.

    The sp axis is the innermost (fastest-varying) one so the ring's neighbours are physical
    neighbours (ICI) and, with several processes per sp group, the ring spans hosts last. On TPU
    each ring then goes round its chips one ICI link per pass where it can (`ring_cycle`).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mesh_config, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    dcn_shape = tuple(int(mesh_config[f"dcn_{a}"]) for a in MESH_AXES)
    if math.prod(dcn_shape) > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(shape, dcn_shape, devices=devices)
    elif devices[0].platform == "tpu":
        # Splitting a physical axis lets e.g. sp=32 lie along two axes of a 4x4x4 slice (the
        # ring then takes one longer hop); without it only shapes aligned to the torus map.
        device_array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    else:
        device_array = np.asarray(devices).reshape(shape)
    if devices[0].platform == "tpu":
        rings = [ring_cycle(list(ring)) for ring in device_array.reshape(-1, device_array.shape[-1])]
        device_array = np.asarray(rings, dtype=object).reshape(device_array.shape)
    return Mesh(device_array, MESH_AXES)


def ring_cycle(ring: list) -> list:
    """The devices of one sp ring (TPU: `coords` are chip coordinates) in an order in which every
    pass, the last back to the first included, crosses one ICI link, where its chips form a box
    that has such a cycle; else as given.

    A ring longer than a torus axis spans a plane or a block of chips, and jax's mesh builder lays
    it out row by row: a row's end and the next row's start are 2 hops apart on a 4x4 plane with
    wrap-around (3 across the planes of a 4x4x2 block, and a 2x2 square comes out in Z order with
    a diagonal step). Every ring pass waits for its slowest transfer, so the cycle matters. The
    reorder moves devices only along sp: each keeps its (dp, fsdp) row, hence its batch rows, and
    rings that are translates of one another (as the builder makes them) get the same pattern.
    """
    coords = [tuple(d.coords) for d in ring]
    if len(set(coords)) != len(ring):  # two cores of one chip, or a ring across slices (dcn_sp)
        return ring
    low = np.min(coords, axis=0)
    extent = tuple(int(n) for n in np.max(coords, axis=0) - low + 1)
    cells = box_cycle(extent)
    if cells is None or len(cells) != len(ring):  # no such cycle, or not a whole box
        return ring
    at = {tuple(int(c) for c in np.subtract(xyz, low)): d for xyz, d in zip(coords, ring)}
    return [at[cell] for cell in cells]


def box_cycle(extent: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """Every cell of a box of `extent` once, in an order in which consecutive cells (the last and
    the first included) differ by 1 along one axis, using no wrap-around; None where there is no
    such cycle: fewer than two axes longer than 1 (a line: the builder's order is as good), or
    every extent odd (a grid with an odd number of cells has no cycle through all of them).

    One even axis is the "row" axis; the other axes are flattened into one line by a snake
    (`_snake`). The cycle goes out along row 0, snakes back and forth over the other rows leaving
    column 0 free, and comes home down column 0."""
    axes = [a for a, n in enumerate(extent) if n > 1]
    even = [a for a in axes if extent[a] % 2 == 0]
    if len(axes) < 2 or not even:
        return None
    rows = even[0]
    others = [a for a in axes if a != rows]
    line = _snake([extent[a] for a in others])
    grid = [(0, j) for j in range(len(line))]
    for i in range(1, extent[rows]):
        columns = range(len(line) - 1, 0, -1) if i % 2 else range(1, len(line))
        grid += [(i, j) for j in columns]
    grid += [(i, 0) for i in range(extent[rows] - 1, 0, -1)]
    cells = []
    for i, j in grid:
        cell = [0] * len(extent)
        cell[rows] = i
        for axis, c in zip(others, line[j]):
            cell[axis] = c
        cells.append(tuple(cell))
    return cells


def _snake(extent: list[int]) -> list[tuple[int, ...]]:
    """Every cell of a box once, consecutive cells 1 apart along one axis (boustrophedon)."""
    if not extent:
        return [()]
    inner = _snake(extent[1:])
    return [(i, *cell) for i in range(extent[0]) for cell in (inner if i % 2 == 0 else inner[::-1])]
