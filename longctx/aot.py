"""Ahead-of-time compilation of the whole train step for a TPU topology, on any machine.

With libtpu installed, `jax.experimental.topologies` hands out abstract TPU devices for a named
topology ("v5p:4x4x4"); lowering and compiling the train step on a mesh of them runs the real TPU
compiler (Mosaic kernels included) here, and `memory_analysis()` says whether it fits in HBM.
`MemoryBreakdown` says what those bytes hold, and `remedy_estimates` what to change.
"""

from __future__ import annotations

import copy
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
from flax import nnx
from jax._src import source_info_util  # names the line of model code behind each residual
from jax.experimental import topologies
from jax.extend import core as jax_core

from longctx import config as config_lib
from longctx import mesh as mesh_lib
from longctx import train
from longctx.model import DecoderBlock

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
class MemoryBreakdown:
    """Per-device bytes by what they hold, so that a step over HBM says what to change.

    Parameters, optimizer state and batch are measured: each leaf's sharding.shard_shape. The
    saved activations are measured too, by one decoder layer's VJP residuals compiled for the same
    mesh (`layer_residuals`), times the number of layers: an estimate of what the layer scan keeps.
    Gradients are an estimate: the gradient tree, sharded as the parameters are. Gradients and
    saved activations lie inside the compiler's temporaries; `largest_buffers` are the biggest
    arrays of the compiled program (not all live at once). Sizes are shapes x itemsize, without
    the padding to TPU tiles that the compiler's own figures include (large arrays barely pad)."""

    parameter_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    batch_bytes: int
    num_layers: int
    saved_bytes_per_layer: int
    residuals: list  # one layer's VJP residuals: shape, dtype, bytes (per device), source, per_layer
    largest_buffers: list  # shape, dtype, bytes (per device), opcode, op_name, source, instructions
    # Global bytes of the state by the mesh axes that shard them ("fsdp,sp", "" = replicated): the
    # per-device state on any other mesh shape, for the remedies.
    state_bytes_by_axes: dict
    # The same layer's saved bytes under remat nothing_saveable, measured when a remedy needs it.
    nothing_saveable_bytes_per_layer: int | None = None

    @property
    def saved_activation_bytes(self) -> int:
        return self.saved_bytes_per_layer * self.num_layers

    def other_temp_bytes(self, temp_bytes: int) -> int:
        """Temporaries that are neither gradients nor saved activations (>= 0: both are estimates)."""
        return max(0, temp_bytes - self.gradient_bytes - self.saved_activation_bytes)


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
    breakdown: MemoryBreakdown | None = None  # what the bytes hold (compile_train_step(breakdown=True))

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
                       devices=None, keep_hlo: bool = False, breakdown: bool = False) -> CompiledStep:
    """Compiles one train step of `config` for `topology` and reports per-device memory.

    `devices` instead of a topology compiles for given (e.g. local CPU) devices. When the TPU
    compiler itself refuses the program for lack of HBM (it does so when the temporaries alone
    exceed the chip), the result carries the temporaries it reported and `oom_at_compile=True`;
    arguments and outputs are then the per-device shard sizes of the state and batch.
    `breakdown=True` also says what the bytes hold (`MemoryBreakdown`; one more, one-layer compile).
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
        hlo = None
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            state_bytes = _shard_bytes(state)
            oom = (_oom_bytes(str(e), state_bytes + _shard_bytes(batch))
                   if "RESOURCE_EXHAUSTED" in str(e) else None)
            if oom is None:
                raise
            result = CompiledStep(**common, argument_bytes=state_bytes + _shard_bytes(batch),
                                  output_bytes=state_bytes, alias_bytes=state_bytes,
                                  temp_bytes=oom[0], compile_seconds=time.perf_counter() - start,
                                  oom_at_compile=True)
        else:
            seconds = time.perf_counter() - start
            memory = compiled.memory_analysis()
            hlo = compiled.as_text() if keep_hlo or breakdown else None
            result = CompiledStep(
                **common, argument_bytes=memory.argument_size_in_bytes,
                output_bytes=memory.output_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
                alias_bytes=memory.alias_size_in_bytes, compile_seconds=seconds,
                hlo=hlo if keep_hlo else None)
    if breakdown:
        result.breakdown = memory_breakdown(config, mesh, layout, setup, state, batch, hlo,
                                            measure_remat_remedy=result.fits is False)
    return result


# ----------------------------------------------------------------------------- memory breakdown


def memory_breakdown(config, mesh, layout: str, setup, state, batch, hlo: str | None, *,
                     measure_remat_remedy: bool = False) -> MemoryBreakdown:
    """Per-device bytes by what they hold (see `MemoryBreakdown`); `hlo` is the compiled step's
    text (None when the compiler refused it: then no largest buffers)."""
    params = _shard_bytes(state.params)
    residuals = layer_residuals(config, mesh, layout, setup)
    nothing_saveable = None
    if measure_remat_remedy and config.model.remat_policy != "nothing_saveable":
        c = copy.deepcopy(config)
        c.unlock()
        c.model.remat_policy = "nothing_saveable"
        nothing_saveable = sum(r["bytes"] for r in layer_residuals(c, mesh, layout, setup)
                               if r["per_layer"])
    return MemoryBreakdown(
        parameter_bytes=params, optimizer_bytes=_shard_bytes(state.opt_state),
        # A cotangent has its primal's shape and dtype; XLA is free to shard (or not to
        # materialise) it differently, hence an estimate.
        gradient_bytes=params, batch_bytes=_shard_bytes(batch), num_layers=config.model.num_layers,
        saved_bytes_per_layer=sum(r["bytes"] for r in residuals if r["per_layer"]),
        residuals=residuals, largest_buffers=[] if hlo is None else largest_buffers(hlo),
        state_bytes_by_axes={"parameters": _global_bytes_by_axes(state.params),
                             "optimizer": _global_bytes_by_axes(state.opt_state)},
        nothing_saveable_bytes_per_layer=nothing_saveable)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * jax.numpy.dtype(dtype).itemsize


def _global_bytes_by_axes(tree) -> dict[str, int]:
    """Global bytes of a tree of sharded ShapeDtypeStructs, keyed by the mesh axes that split them."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        axes = []
        for entry in x.sharding.spec:
            axes += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        key = ",".join(axes)
        out[key] = out.get(key, 0) + _nbytes(x.shape, x.dtype)
    return out


def bytes_on_mesh(bytes_by_axes: dict[str, int], mesh_shape: dict) -> int:
    """Per-device bytes of `_global_bytes_by_axes` on a mesh of `mesh_shape` (even splits assumed)."""
    return sum(b // math.prod(mesh_shape[a] for a in axes.split(",") if a)
               for axes, b in bytes_by_axes.items())


_LAYER_INPUT_LOGICAL = ("activation_batch", "activation_length", "activation_embed")
# Residuals that are a layer's arguments or constants: what they are, and whether the scan over
# layers keeps one per layer (the layer input) or they are stored once anyway.
_SHARED_RESIDUALS = {
    "input": ("the layer's input (the scan keeps it per layer)", True),
    "parameter": ("a parameter of the layer (counted once, under parameters)", False),
    "batch": ("the batch's positions or segment ids (shared by every layer)", False),
    "constant": ("a constant (shared by every layer)", False),
}


def layer_residuals(config, mesh, layout: str, setup) -> list[dict]:
    """What the backward pass keeps of one decoder layer, per device, largest first.

    One `DecoderBlock` (built from the config, with the config's remat policy) is traced through
    `jax.vjp` on global abstract inputs sharded as in the train step: the layer input as Decoder
    constrains it, the batch's positions and segment ids, the layer's slice of the stacked
    parameters with their own shardings minus the stacked axis. The residuals are the leaves of
    the VJP function; compiling the function that returns them for `mesh` gives their per-device
    shapes (the ring's come out of its shard_map). Residuals that are the layer's parameters or the
    batch are stored once, not per layer (`per_layer=False`)."""
    m = config.model
    with jax.default_device(jax.devices("cpu")[0]):  # Rngs(0) is concrete: not on abstract TPUs
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderBlock(config, rngs=nnx.Rngs(0))))

    def one_layer_slice(a, s):  # the stacked "layers" axis is the leading one (nnx.vmap, axis 0)
        sharding = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)

    block_state = jax.tree.map(one_layer_slice, setup.abstract_state.params["blocks"],
                               setup.state_shardings.params["blocks"])
    tokens = (config.data.global_batch_size, config.data.seq_len)
    x = jax.ShapeDtypeStruct((*tokens, m.d_model), jax.numpy.dtype(m.dtype),
                             sharding=mesh_lib.logical_sharding(mesh, _LAYER_INPUT_LOGICAL))
    ids = jax.ShapeDtypeStruct(tokens, jax.numpy.int32, sharding=setup.batch_sharding)
    args = (x, block_state, ids, ids if config.attention.use_segment_ids else None)
    kinds = [kind for arg, kind in zip(args, ("input", "parameter", "batch", "batch"))
             for _ in jax.tree.leaves(arg)]

    def layer(x, block_state, positions, segment_ids):
        block = nnx.merge(graphdef, block_state)
        return block(x, positions, segment_ids, config=config, layout=layout)

    with jax.set_mesh(mesh):
        closed, (_, vjp_shape) = jax.make_jaxpr(lambda *a: jax.vjp(layer, *a), return_shape=True)(*args)
        shardings = jax.jit(lambda *a: jax.tree.leaves(jax.vjp(layer, *a)[1])).lower(
            *args).compile().output_shardings
    jaxpr = closed.jaxpr
    saved = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(vjp_shape)):]
    assert len(saved) == len(shardings), (len(saved), len(shardings))
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    argument = dict(zip(jaxpr.invars, kinds))
    out = []
    for v, sharding in zip(saved, shardings):
        shape = tuple(sharding.shard_shape(v.aval.shape))
        if isinstance(v, jax_core.Literal) or v not in producer:  # an argument, or a constant
            key = "constant" if isinstance(v, jax_core.Literal) else argument.get(v, "constant")
            source, per_layer = _SHARED_RESIDUALS[key]
        else:
            source, per_layer = _residual_source(producer[v]), True
        out.append({"shape": list(shape), "dtype": str(v.aval.dtype),
                    "bytes": _nbytes(shape, v.aval.dtype), "source": source, "per_layer": per_layer})
    return sorted(out, key=lambda r: (not r["per_layer"], -r["bytes"]))


def _residual_source(eqn) -> str:
    """'dot_general at model.py:180 (DecoderBlock._qkv)': the primitive and the model line."""
    where = re.sub(r"^.*/", "", source_info_util.summarize(eqn.source_info))
    where = re.sub(r":\d+ \(", " (", where)  # drop the column
    name = eqn.params.get("name") if eqn.primitive.name in ("jit", "pjit", "name") else None
    what = eqn.primitive.name + (f" {name!r}" if name else "")
    if eqn.primitive.name == "shard_map":
        what = "shard_map (the ring attention's own saved values)"
    return f"{what} at {where}"


# HLO instructions whose result is another buffer (or a view of one), not a new array.
_ALIASING_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                 "constant", "copy-start", "optimization-barrier", "after-all", "add-dependency",
                 "all-gather-start", "all-reduce-start", "collective-permute-start", "async-start",
                 "async-update", "send", "recv", "send-done", "recv-done"}
_HLO_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_HLO_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*)$")
_HLO_OPCODE = re.compile(r" ([a-z][a-z0-9-]*)\(")
_HLO_MEMORY_SPACE = re.compile(r"(?<![A-Z])S\((\d+)\)")
_HLO_DTYPE_PREFIX = {"f": "float", "bf": "bfloat", "s": "int", "u": "uint", "c": "complex"}


def _hlo_dtype(name: str) -> tuple[str, float] | None:
    """'f32' -> ('float32', 4), 'bf16' -> ('bfloat16', 2), 'pred' -> ('bool', 1); None: no array."""
    if name == "pred":
        return "bool", 1
    m = re.fullmatch(r"(bf|f|s|u|c)(\d+)(\w*)", name)  # f32, bf16, s32, f8e4m3fn; not token
    if m is None:
        return None
    return (name if m.group(3) else _HLO_DTYPE_PREFIX[m.group(1)] + m.group(2)), int(m.group(2)) / 8


def largest_buffers(hlo: str, n: int = 8) -> list[dict]:
    """The `n` largest arrays the compiled (SPMD-partitioned, so per-device) program creates.

    Every instruction outside fused computations makes a buffer, unless it only names another
    (parameters, tuples, bitcasts, loops' results) or lives outside HBM (a memory space S(n>0),
    e.g. TPU VMEM). Arrays of one shape, dtype and op_name are listed once, with how many
    instructions produce them (an array updated in place shows once per updating instruction).
    Sizes are unpadded (TPU tiling can add some). Sorted by bytes, largest first."""
    sources = _hlo_stack_sources(hlo)
    fused = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo))
    for group in re.findall(r"called_computations=\{([^}]*)\}", hlo):
        fused.update(re.findall(r"%([\w.\-]+)", group))
    found: dict[tuple, dict] = {}
    skipping = True
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            skipping = header.group(1) in fused
            continue
        m = _HLO_INSTRUCTION.match(line)
        if skipping or not m:
            continue
        op = _HLO_OPCODE.search(m.group(2))
        if op is None or op.group(1) in _ALIASING_OPS or op.group(1).endswith("-start"):
            continue
        if 'custom_call_target="AllocateBuffer"' in line:
            continue  # an empty buffer that a later (in-place) instruction fills and names
        op_name = re.search(r'op_name="([^"]*)"', line)
        op_name = re.sub(r"^jit\([^)]*\)/", "", op_name.group(1)) if op_name else ""
        frame = re.search(r"stack_frame_id=(\d+)", line)
        for name, dims, layout in _HLO_ARRAY.findall(m.group(2)[:op.start()]):
            space, dtype = _HLO_MEMORY_SPACE.search(layout or ""), _hlo_dtype(name)
            if (space and space.group(1) != "0") or dtype is None:
                continue
            shape = [int(d) for d in dims.split(",") if d]
            entry = found.setdefault((name, tuple(shape), op_name), {
                "shape": shape, "dtype": dtype[0], "bytes": int(math.prod(shape) * dtype[1]),
                "opcode": op.group(1), "op_name": op_name,
                "source": sources.get(frame.group(1), "") if frame else "", "instructions": 0})
            entry["instructions"] += 1
    ranked = sorted(found.values(), key=lambda b: (-b["bytes"], b["op_name"], b["dtype"]))
    return ranked[:n]


def _hlo_stack_sources(hlo: str) -> dict[str, str]:
    """stack_frame_id -> 'model.py:180 DecoderBlock._qkv', from the HLO text's stack tables
    (each frame's own, innermost, location)."""
    def table(name):  # the "id value" lines under a heading, up to the next blank line
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", hlo, re.S | re.M)
        return dict(line.split(" ", 1) for line in m.group(1).splitlines()) if m else {}

    files, functions, out = table("FileNames"), table("FunctionNames"), {}
    locations = {k: re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", v)
                 for k, v in table("FileLocations").items()}
    for frame, value in table("StackFrames").items():
        loc = locations.get(re.search(r"file_location_id=(\d+)", value).group(1))
        if loc:
            file, function = (t.get(i, "?").strip('"') for t, i in ((files, loc[1]), (functions, loc[2])))
            out[frame] = f"{os.path.basename(file)}:{loc[3]} {function}"
    return out


def cores_per_chip(devices) -> int:
    chips = {tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)}
    return max(1, len(devices) // len(chips))


def per_device_batch(config, mesh_shape: dict) -> int:
    """Rows per device. `mesh_shape` is the whole mesh's (a multi-slice mesh's dp and fsdp already
    include dcn_dp and dcn_fsdp: create_hybrid_device_mesh multiplies them in)."""
    return config.data.global_batch_size // (mesh_shape[mesh_lib.DP] * mesh_shape[mesh_lib.FSDP])


@dataclasses.dataclass
class Remedy:
    override: str  # what to change, as estimate.py flags where it is one
    saved_bytes: int  # per device, estimated
    total_bytes: int  # per device after the change, estimated
    basis: str  # how the estimate was made


def remedy_estimates(config: ml_collections.ConfigDict, result: CompiledStep) -> list[Remedy]:
    """Changes that should bring a step that does not fit under HBM, most bytes saved first.

    With a breakdown, each part moves by what it depends on: parameters, optimizer state and
    gradients (~ parameters) by how the new mesh shards them (`bytes_on_mesh`); saved activations,
    the batch and the other temporaries with the tokens per chip, batch/(dp*fsdp) x seq/sp; a
    remat change by the saved activations measured under nothing_saveable. The other temporaries
    also hold things that do not scale with tokens (gathered weights), so halving them is
    optimistic. Without a breakdown: arguments are the state, temporaries scale with tokens.
    Every figure is an estimate; verify with estimate.py."""
    hbm = result.hbm_bytes
    if hbm is None or result.fits:
        return []
    b, shape = result.breakdown, dict(result.mesh_shape)
    dp, fsdp, sp = shape[mesh_lib.DP], shape[mesh_lib.FSDP], shape[mesh_lib.SP]
    if b is not None:
        saved = b.saved_activation_bytes
        tokens = b.batch_bytes + saved + b.other_temp_bytes(result.temp_bytes)

        def state_on(mesh_shape):  # parameters + optimizer state + gradients on another mesh
            by_axes = b.state_bytes_by_axes
            params = bytes_on_mesh(by_axes["parameters"], mesh_shape)
            return 2 * params + bytes_on_mesh(by_axes["optimizer"], mesh_shape)

        state_now = state_on(shape)
    else:  # the compiler's totals only
        saved, state_now = None, result.argument_bytes
        tokens = result.temp_bytes + result.output_bytes - result.alias_bytes

        def state_on(mesh_shape):  # arguments split over fsdp, as the old first-order model did
            return state_now * fsdp // mesh_shape[mesh_lib.FSDP]

    halved_tokens = "tokens per chip halved" + (", state re-sharded on the new mesh" if b else "")
    est = []

    def add(override, state_after, tokens_after, basis):
        change = (state_now - state_after) + (tokens - tokens_after)
        est.append(Remedy(override, int(change), int(result.total_bytes - change), basis))

    policy = config.model.remat_policy
    if policy != "nothing_saveable":
        override = f"--config.model.remat_policy=nothing_saveable (now {policy!r})"
        if b is not None and b.nothing_saveable_bytes_per_layer is not None:
            # The layer being differentiated has its activations back for its own backward.
            after = b.nothing_saveable_bytes_per_layer * b.num_layers + b.saved_bytes_per_layer
            add(override, state_now, tokens - saved + after,
                "saved activations re-measured under nothing_saveable, plus one layer recomputed")
        else:  # ~1/4 of the temporaries: a rough factor from Llama-shaped blocks
            add(override, state_now, tokens / 4, "rough: temporaries / 4")
    fits_ring = config.data.seq_len % (2 * sp * config.attention.block_size) == 0
    if fsdp % 2 == 0 and fits_ring:
        add(f"--config.mesh.sp={2 * sp} --config.mesh.fsdp={fsdp // 2} (ring over {2 * sp} chips)",
            state_on({**shape, mesh_lib.SP: 2 * sp, mesh_lib.FSDP: fsdp // 2}), tokens / 2, halved_tokens)
    elif dp % 2 == 0 and fits_ring:
        add(f"--config.mesh.sp={2 * sp} --config.mesh.dp={dp // 2}",
            state_on({**shape, mesh_lib.SP: 2 * sp, mesh_lib.DP: dp // 2}), tokens / 2, halved_tokens)
    rows = per_device_batch(config, shape)
    if rows > 1:
        add(f"--config.data.global_batch_size={config.data.global_batch_size // 2} "
            f"(per-device batch {rows} -> {rows // 2})", state_now, tokens / 2, "tokens per chip halved")
    add(f"a topology with 2x the chips and --config.mesh.sp={2 * sp} (half the tokens per chip)",
        state_on({**shape, mesh_lib.SP: 2 * sp}) if b else state_now, tokens / 2, halved_tokens)
    if config.data.seq_len >= 2 * sp * config.attention.block_size:
        add(f"--config.data.seq_len={config.data.seq_len // 2}", state_now, tokens / 2,
            "tokens per chip halved")
    return sorted(est, key=lambda r: -r.saved_bytes)


def suggest_remedies(config: ml_collections.ConfigDict, result: CompiledStep) -> list[str]:
    """`remedy_estimates` as lines: the override, bytes saved and the per-chip total after it."""
    hbm = result.hbm_bytes
    lines = []
    for r in remedy_estimates(config, result):
        verdict = "fits" if r.total_bytes <= hbm else "still over"
        lines.append(f"{r.override}: saves ~{r.saved_bytes / GIB:.1f} GiB -> ~{r.total_bytes / GIB:.1f} "
                     f"GiB per chip, {verdict} (estimate: {r.basis})")
    return lines


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps the number >= 1, fixed width."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:8.2f} {unit}"
    return f"{n:8.0f} B  "


def _array(shape, dtype: str) -> str:
    short = re.sub(r"^(b?)float", r"\1f", re.sub(r"^(u?)int", lambda m: m.group(1) or "i", dtype))
    return f"{short}[{','.join(map(str, shape))}]"


def format_report(config, result: CompiledStep, *, residual_lines: int = 8) -> str:
    """The human-readable memory report estimate.py prints."""
    g = _size
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
        f"  outputs      {g(result.output_bytes)}   ({g(result.alias_bytes).strip()} of them "
        "aliased to donated arguments)",
        f"  temporaries  {g(result.temp_bytes)}",
        f"  total        {g(result.total_bytes)}",
    ]
    if result.breakdown is not None:
        lines += _breakdown_lines(result, residual_lines)
    if result.hbm_bytes is None:
        lines.append(f"chip HBM     unknown for {result.device_kind!r}: cannot say whether it fits")
        return "\n".join(lines)
    lines.append(f"chip HBM     {g(result.hbm_bytes)}")
    pct = 100 * result.total_bytes / result.hbm_bytes
    lines.append(f"fits         {'yes' if result.fits else 'NO'} ({pct:.0f}% of HBM)")
    remedies = suggest_remedies(config, result)
    if remedies:
        lines.append("suggested remedies, most bytes saved first (estimates from the breakdown; verify "
                     "with estimate.py):" if result.breakdown else
                     "suggested remedies (first-order estimates, most effective first):")
        lines += [f"  {r}" for r in remedies]
    return "\n".join(lines)


def _breakdown_lines(result: CompiledStep, residual_lines: int) -> list[str]:
    b, g = result.breakdown, _size

    def approx(n):  # "~" in the padding, so that the columns stay aligned
        text = g(n)
        return ("~" + text.lstrip()).rjust(len(text))

    lines = [
        "per-device breakdown (~ = estimate; unpadded sizes, the compiler's include TPU tiling):",
        f"  parameters         {g(b.parameter_bytes)}   params of the train state, as sharded",
        f"  optimizer state    {g(b.optimizer_bytes)}   AdamW moments and counters, as sharded",
        f"  batch              {g(b.batch_bytes)}   this device's batch shard",
        f"  gradients          {approx(b.gradient_bytes)}   gradient tree sharded like the params "
        "(part of temporaries)",
        f"  saved activations  {approx(b.saved_activation_bytes)}   {b.num_layers} layers x "
        f"{g(b.saved_bytes_per_layer).strip()} measured on one layer (part of temporaries)",
        f"  other temporaries  {approx(b.other_temp_bytes(result.temp_bytes))}   the rest: loss chunks, "
        "ring buffers, gathered weights, recomputation",
    ]
    groups: dict[tuple, list] = {}
    for r in b.residuals:
        if r["per_layer"]:
            groups.setdefault((_array(r["shape"], r["dtype"]), r["bytes"], r["source"]), []).append(r)
    ranked = sorted(groups.items(), key=lambda kv: -kv[0][1] * len(kv[1]))
    lines.append("what one layer saves for the backward, per device, largest first:")
    for (array, nbytes, source), same in ranked[:residual_lines]:
        count = f"{len(same)} x " if len(same) > 1 else ""
        lines.append(f"  {g(nbytes * len(same))}  {count}{array}  {source}")
    if len(ranked) > residual_lines:
        rest = sum(k[1] * len(v) for k, v in ranked[residual_lines:])
        lines.append(f"  {g(rest)}  {len(ranked) - residual_lines} more kinds (--json lists them all)")
    if b.largest_buffers:
        lines.append("largest arrays in the compiled step, per device (from its HLO; not all live at once):")
        for buf in b.largest_buffers:
            count = f" ({buf['instructions']} instructions)" if buf["instructions"] > 1 else ""
            where = f" [{buf['source']}]" if buf["source"] else ""
            lines.append(f"  {g(buf['bytes'])}  {_array(buf['shape'], buf['dtype'])} {buf['opcode']}"
                         f"{count}  {buf['op_name'] or '-'}{where}")
    return lines
