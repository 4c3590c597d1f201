"""What a compiled train step's per-device bytes hold: state shards, one layer's saved
activations (its VJP residuals, compiled for the same mesh), and the largest arrays of the
compiled HLO. `longctx.plan.aot` attaches a `MemoryBreakdown` to a compile; estimate.py prints it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re

import jax
from flax import nnx
from jax._src import source_info_util  # names the line of model code behind each residual
from jax.extend import core as jax_core

from longctx.model.decoder import DecoderBlock
from longctx.parallel import mesh as mesh_lib
from longctx.train import state as train_state
from longctx.train import steps as train_steps


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


def memory_breakdown(config, mesh, layout: str, setup, state, batch, hlo: str | None, *,
                     measure_remat_remedy: bool = False) -> MemoryBreakdown:
    """Per-device bytes by what they hold (see `MemoryBreakdown`); `hlo` is the compiled step's
    text (None when the compiler refused it: then no largest buffers)."""
    params = train_state.shard_bytes(state.params)
    residuals = layer_residuals(config, mesh, layout, setup)
    nothing_saveable = None
    if measure_remat_remedy and config.model.remat_policy != "nothing_saveable":
        c = copy.deepcopy(config)
        c.unlock()
        c.model.remat_policy = "nothing_saveable"
        nothing_saveable = sum(r["bytes"] for r in layer_residuals(c, mesh, layout, setup)
                               if r["per_layer"])
    return MemoryBreakdown(
        parameter_bytes=params, optimizer_bytes=train_state.shard_bytes(state.opt_state),
        # A cotangent has its primal's shape and dtype; XLA is free to shard (or not to
        # materialise) it differently, hence an estimate.
        gradient_bytes=params, batch_bytes=train_state.shard_bytes(batch), num_layers=config.model.num_layers,
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
        key = ",".join(mesh_lib.spec_axes(x.sharding.spec))
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
    # A hybrid model's layers keep residuals of the same shapes whatever their type (q, k, v, the
    # output and its logsumexp), so its first type (index 0) stands for every layer.
    with jax.default_device(jax.devices("cpu")[0]):  # Rngs(0) is concrete: not on abstract TPUs
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderBlock(config, rngs=nnx.Rngs(0))))

    def one_layer_slice(a, s):  # the stacked "layers" axis is the leading one (nnx.vmap, axis 0)
        sharding = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)

    block_state = jax.tree.map(one_layer_slice, setup.abstract_state.params["blocks"],
                               setup.state_shardings.params["blocks"])
    # one micro-batch's rows: what the step's scan over them differentiates at a time
    tokens = (config.data.global_batch_size // train_steps.grad_accum_steps(config), config.data.seq_len)
    x = jax.ShapeDtypeStruct((*tokens, m.d_model), jax.numpy.dtype(m.dtype),
                             sharding=mesh_lib.logical_sharding(mesh, _LAYER_INPUT_LOGICAL))
    ids = jax.ShapeDtypeStruct(tokens, jax.numpy.int32, sharding=setup.batch_sharding)
    args = (x, block_state, ids, ids if config.attention.use_segment_ids else None)
    kinds = [kind for arg, kind in zip(args, ("input", "parameter", "batch", "batch"))
             for _ in jax.tree.leaves(arg)]

    def layer(x, block_state, positions, segment_ids):
        block = nnx.merge(graphdef, block_state)
        return block(x, positions, segment_ids, 0, config=config, layout=layout)

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
            source, per_layer = _residual_source(_through_precision_marks(producer[v], producer)), True
        out.append({"shape": list(shape), "dtype": str(v.aval.dtype),
                    "bytes": _nbytes(shape, v.aval.dtype), "source": source, "per_layer": per_layer})
    return sorted(out, key=lambda r: (not r["per_layer"], -r["bytes"]))


def _through_precision_marks(eqn, producer: dict):
    """The equation behind a value a checkpoint saves: JAX's remat marks each value it keeps with a
    reduce_precision of the value's own precision (a no-op), which names nothing; the value's maker
    (a dot_general, or a `name` for checkpoint_name's named outputs) does."""
    while eqn.primitive.name == "reduce_precision" and eqn.invars[0] in producer:
        eqn = producer[eqn.invars[0]]
    return eqn


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
    """stack_frame_id -> 'decoder.py:180 DecoderBlock._qkv', from the HLO text's stack tables
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
