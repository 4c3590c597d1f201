"""Ahead-of-time compilation of the whole train step for a TPU topology, on any machine.

With libtpu installed, `jax.experimental.topologies` hands out abstract TPU devices for a named
topology ("v5p:4x4x4"); lowering and compiling the train step on a mesh of them runs the real TPU
compiler (Mosaic kernels included) here, and `memory_analysis()` says whether it fits in HBM.
`longctx.plan.memory.MemoryBreakdown` says what those bytes hold, and `remedy_estimates` what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import time
from typing import Callable

# libtpu takes a machine-wide lock file when it loads; a second process that only wants abstract
# topologies for ahead-of-time compiles (tests, estimate.py, another engineer's job) would fail
# with "Internal error when accessing libtpu multi-process lockfile". No TPU is opened here.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import ml_collections
from jax.experimental import topologies

from longctx import config as config_lib
from longctx import errors
from longctx.parallel import devices as devices_lib
from longctx.parallel import mesh as mesh_lib
from longctx.plan import auto, hardware, measured_memory, memory
from longctx.train import state as train_state
from longctx.train import steps as train_steps

GIB = 1024 ** 3

# HBM per chip (bytes) by the device_kind libtpu reports: the planner's chip table's.
HBM_BYTES_BY_CHIP = {kind: chip.hbm_bytes for chip in hardware.CHIPS.values() if chip.torus_dims
                     for kind in chip.device_kinds}


# libtpu 0.10.2's compiler aborts the process (a failed check in tpu_layout_assignment.cc) on every
# train step with attention.residuals=offload_qkv that we compiled for a topology (the tiny model
# and the 8B and 70B presets; any strategy, any remat policy), so such a compile is refused with a
# sentence before it starts. Whether a TPU VM's own compile does the same is not known here.
OFFLOAD_QKV = "offload_qkv"
OFFLOAD_ON_TPU = ("attention.residuals=offload_qkv does not compile for TPU with this libtpu (its "
                  "compiler aborts in layout assignment): use attention.residuals=recompute_qkv, "
                  "which keeps as little per layer on the device.")

# Set while libtpu starts on a machine without a TPU (see _topology).
_ONE_HOST_ALONE = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def _topology(name: str):
    """jax's description of a TPU topology. Without a TPU here, libtpu (loaded by the first call
    only to describe topologies) still looks for the slice it runs on and prints half a dozen
    lines on stderr, an INVALID_ARGUMENT about worker host names among them. Told it is one host
    alone while it starts, it prints nothing and compiles the same (the llama3_8b_128k step on
    v5p:4x4x4: 15.93 GiB either way). The settings are taken back at once: a process started
    from this one would read TPU_WORKER_HOSTNAMES as a TPU pod's (mesh.maybe_initialize_distributed).
    On a TPU VM nothing is set. A slice smaller than a host of its chip (v5e:1x1, the single-chip
    VM: libtpu's default host is 2x2 chips, which "1x1" does not divide) is its own host."""
    with contextlib.ExitStack() as stack:
        if not devices_lib.has_accelerator():
            stack.enter_context(_environment(_ONE_HOST_ALONE))
        try:
            return topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # noqa: BLE001  (libtpu's own error: kept where this is not it)
            if "chips_per_host_bounds" not in str(e):
                raise
            dims = [int(n) for n in name.partition(":")[2].split("x")]
            return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                chips_per_host_bounds=tuple(dims + [1] * (3 - len(dims))))


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    """`settings` in os.environ (where not set already) for the block, then taken back."""
    added = {k: v for k, v in settings.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def source_digest() -> str:
    """A digest of longctx's own source files: what a stored compile was made with (a result
    cached under it is stale once any of them changes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def libtpu_available() -> bool:
    try:
        _topology("v5p:2x2x1")
        return True
    except Exception:  # noqa: BLE001  (no libtpu, or one that cannot describe topologies)
        return False


def topology_devices(topology: str) -> list:
    """Abstract TPU devices for e.g. "v5p:2x2x2" (libtpu names: v4, v5e, v5p, v6e, tpu7x; tpu7x
    gives two devices per chip, its TensorCores)."""
    try:
        return list(_topology(topology).devices)
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
    # the compiling process's CPU time over the same span (all its threads): on a shared machine a
    # steadier measure of the compiler's work than the wall clock, which waits for other processes
    compile_cpu_seconds: float | None = None
    cores_per_chip: int = 1  # libtpu's v4 topologies give one device per TensorCore (2 per chip)
    oom_at_compile: bool = False  # the TPU compiler refused it: temporaries alone exceed HBM
    hlo: str | None = dataclasses.field(default=None, repr=False)  # compiled HLO (keep_hlo=True)
    breakdown: memory.MemoryBreakdown | None = None  # what the bytes hold (compile_train_step(breakdown=True))
    # XLA's own cost analysis of the compiled program (per device): FLOPs and HBM bytes accessed.
    cost_flops: float | None = None
    cost_bytes_accessed: float | None = None

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def hbm_bytes(self) -> int | None:
        """HBM per device: the chip's, shared by its devices when each TensorCore is one."""
        chip = HBM_BYTES_BY_CHIP.get(self.device_kind)
        return None if chip is None else chip // self.cores_per_chip

    @property
    def peak_bytes(self) -> int:
        """What the chip should hold while the step runs: on a chip whose runtime was measured
        (plan/measured_memory.py), state and batch plus the share of the temporaries it holds;
        elsewhere the compiler's whole figure."""
        measured = measured_memory.runtime_bytes(
            self.device_kind, self.total_bytes - self.temp_bytes, self.temp_bytes)
        return self.total_bytes if measured is None else measured

    @property
    def fits(self) -> bool | None:
        """The compiler's own test (its temporaries fit the chip) and the runtime's (the peak)."""
        if self.oom_at_compile:
            return False
        hbm = self.hbm_bytes
        return None if hbm is None else self.temp_bytes <= hbm and self.peak_bytes <= hbm


def _oom_bytes(message: str, argument_bytes: int = 0):
    """(temporaries, available) bytes from the TPU compiler's out-of-HBM message, or None
    (errors.out_of_memory reads it): where it counts the whole program, the temporaries are the
    rest after the arguments."""
    oom = errors.out_of_memory(message)
    if oom is None or oom.memory != errors.HBM:
        return None
    temporaries = oom.needed if oom.counts == "temporaries" else max(0, oom.needed - argument_bytes)
    return temporaries, oom.available


def compile_duration(config: ml_collections.ConfigDict) -> str:
    """How long a compile of the whole step takes, to say before it starts: the 8B and 70B presets'
    took 34-266 s on a 2-core machine (docs/fit_*.md), the tiny preset's a few seconds."""
    params = config_lib.num_params_estimate(config)
    return "takes seconds" if params < 10 ** 8 else "takes 1-5 minutes" if params >= 10 ** 9 else \
        "takes up to a few minutes"


def compile_train_step(config: ml_collections.ConfigDict, topology: str | None = None, *,
                       devices=None, keep_hlo: bool = False, breakdown: bool = False,
                       say: Callable[[str], None] | None = None) -> CompiledStep:
    """Compiles one train step of `config` for `topology` and reports per-device memory.

    `devices` instead of a topology compiles for given (e.g. local CPU) devices. When the TPU
    compiler itself refuses the program for lack of HBM (it does so when the temporaries alone
    exceed the chip), the result carries the temporaries it reported and `oom_at_compile=True`;
    arguments and outputs are then the per-device shard sizes of the state and batch.
    `breakdown=True` also says what the bytes hold (`MemoryBreakdown`; one more, one-layer compile).
    `say`: called with a line before each compile and after the step's (a user waits minutes).
    """
    say = say or (lambda line: None)
    if devices is None:
        devices = topology_devices(topology)
    devices = list(devices)
    topology = topology or f"{devices[0].platform}:{len(devices)}"
    config = auto.resolve(config, devices).config  # the auto keys, as a run would start
    sizes = config_lib.validate(config, num_devices=len(devices))
    if devices[0].platform == "tpu" and config.attention.get("residuals") == OFFLOAD_QKV:
        raise config_lib.ConfigError(OFFLOAD_ON_TPU)
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    say(f"compiling the train step for {topology} ({compile_duration(config)}) ...")
    layout = train_state.resolve_layout(config, sizes[mesh_lib.SP])
    # make_setup builds a concrete PRNG key; under set_mesh of abstract TPU devices that would
    # try to run on them. Its shardings name the mesh explicitly, so it needs no mesh context.
    with jax.default_device(jax.devices("cpu")[0]):
        setup = train_state.make_setup(config, mesh, layout)
    common = dict(topology=topology, device_kind=devices[0].device_kind,
                  num_devices=len(devices), mesh_shape=dict(mesh.shape),
                  cores_per_chip=cores_per_chip(devices))
    with jax.set_mesh(mesh):
        train_step, _ = train_steps.jit_steps(config, setup)
        state = train_state.abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        batch = train_steps.abstract_batch(config, setup)
        start, cpu_start = time.perf_counter(), time.process_time()
        lowered = train_step.lower(state, batch)
        hlo = None
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            state_bytes = train_state.shard_bytes(state)
            oom = _oom_bytes(str(e), state_bytes + train_state.shard_bytes(batch))
            if oom is None:
                raise
            result = CompiledStep(**common, argument_bytes=state_bytes + train_state.shard_bytes(batch),
                                  output_bytes=state_bytes, alias_bytes=state_bytes,
                                  temp_bytes=oom[0], compile_seconds=time.perf_counter() - start,
                                  compile_cpu_seconds=time.process_time() - cpu_start,
                                  oom_at_compile=True)
        else:
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            stats = compiled.memory_analysis()
            hlo = compiled.as_text() if keep_hlo or breakdown else None
            cost = _cost_analysis(compiled)
            result = CompiledStep(
                **common, argument_bytes=stats.argument_size_in_bytes,
                output_bytes=stats.output_size_in_bytes, temp_bytes=stats.temp_size_in_bytes,
                alias_bytes=stats.alias_size_in_bytes, compile_seconds=seconds,
                compile_cpu_seconds=cpu_seconds,
                hlo=hlo if keep_hlo else None, cost_flops=cost.get("flops"),
                cost_bytes_accessed=cost.get("bytes accessed"))
    say(f"compiled in {result.compile_seconds:.0f} s"
        + ("; compiling one layer of it for the breakdown ..." if breakdown else "."))
    if breakdown:
        result.breakdown = memory.memory_breakdown(config, mesh, layout, setup, state, batch, hlo,
                                            measure_remat_remedy=result.fits is False)
    return result


def _cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program ({} where the backend gives none)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (a backend without one)
        return {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    return dict(cost or {})


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
            params = memory.bytes_on_mesh(by_axes["parameters"], mesh_shape)
            return 2 * params + memory.bytes_on_mesh(by_axes["optimizer"], mesh_shape)

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
    # The activations are one micro-batch's: halving the batch halves them only where a
    # micro-batch holds more than one row per device (train.grad_accum_steps splits the rest).
    accum = train_steps.grad_accum_steps(config)
    rows = per_device_batch(config, shape) // accum
    if rows > 1:
        add(f"--config.data.global_batch_size={config.data.global_batch_size // 2} "
            f"(rows per device {'per micro-batch ' if accum > 1 else ''}{rows} -> {rows // 2})",
            state_now, tokens / 2, "tokens per chip halved")
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
    if result.peak_bytes != result.total_bytes:
        share = measured_memory.program_share(result.device_kind)
        lines.append(f"at run time  {g(result.peak_bytes)}   (state and batch, and {share:.0%} of the "
                     f"temporaries: the most a {result.device_kind} runtime was measured to hold; "
                     "plan/measured_memory.py)")
    pct = 100 * result.peak_bytes / result.hbm_bytes
    lines.append(f"fits         {'yes' if result.fits else 'NO'} ({pct:.0f}% of HBM"
                 + (", and the temporaries alone are over it: the compiler refuses the step)"
                    if result.temp_bytes > result.hbm_bytes else ")"))
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
