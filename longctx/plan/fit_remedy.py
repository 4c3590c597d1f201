"""What to change when no candidate of a plan fits, or when the compiler refused a run's train step
for lack of memory: the nearest run that does, by the memory model.

    why_nothing_fits(config, topology) -> one sentence (for scripts/plan.py's exit 2)
    out_of_memory_advice(config, out_of_memory, devices) -> the nearest change, in words
        (scripts/train.py hands it to the training loop, which says it when a compile is refused)

Two ways out, each the smallest change of one thing: the smallest slice of the same chip that
fits the config as it is (the slice grown one axis doubling at a time, the shortest axis first,
as TPU slices come), and the longest sequence that fits this slice (data.seq_len halved). Only
the memory model decides (planner.smallest_memory, no step time), which is what a plan prunes
by; the compile of the plan that follows is the check.

After a compile refused for lack of HBM, the memory model is first fitted to the compiler's own
figure (its activation scale, the part the compiler's copies and padding inflate, set so that the
model says what the compiler said), then asked of single changes, nearest first: those that keep
the run's arithmetic (attention.residuals=recompute_qkv, a remat policy that keeps less,
model.mlp_chunk_size, train.grad_accum_steps), then more chips (the smallest slice), then fewer
tokens (a shorter sequence). A scoped VMEM overflow is one kernel's: a smaller attention block.
"""

from __future__ import annotations

import copy
import dataclasses

from longctx import errors
from longctx import config as config_lib
from longctx.model import decoder
from longctx.parallel import mesh as mesh_lib
from longctx.plan import auto, hardware, memory_model, planner

# The largest slice of each chip (cloud.google.com/tpu/docs, each version's system architecture
# page: v4 4,096 chips, v5e and v6e 256, v5p 8,960, TPU7x 9,216); GPUs: as many as the search goes.
MAX_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256, "tpu7x": 9216}
MAX_GPUS = 16_384
# The shortest sequence the search tries.
MIN_SEQ_LEN = 1024


def _fits(config, topology: hardware.Topology, open_keys, scale: float = memory_model.ACTIVATION_SCALE) -> bool:
    need = planner.smallest_memory(config, topology, open_keys, scale)
    return need is not None and need <= planner.HBM_HEADROOM * topology.device.hbm_bytes


def larger_slices(topology: hardware.Topology):
    """The slices after `topology` of its chip, each twice the chips of the last: the shortest
    axis doubles (v5e:2x2 -> 2x4 -> 4x4 -> 4x8 ...; v5p:4x4x4 -> 4x4x8 -> 4x8x8 ...)."""
    shape = list(topology.shape)
    while True:
        shape[shape.index(min(shape))] *= 2
        shape.sort()
        larger = hardware.parse_topology(f"{topology.chip.name}:{'x'.join(map(str, shape))}")
        if larger.num_chips > max_chips(topology.chip):
            return
        yield larger


def max_chips(chip: hardware.Chip) -> int:
    return MAX_CHIPS.get(chip.name, MAX_GPUS)


def smallest_slice(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE,
                   scale: float = memory_model.ACTIVATION_SCALE):
    """The first of larger_slices that some candidate fits, or None."""
    return next((t for t in larger_slices(topology) if _fits(config, t, open_keys, scale)), None)


def _halving(config, topology, key: str, smallest: int, open_keys,
             scale: float = memory_model.ACTIVATION_SCALE) -> int | None:
    """The largest of data.<key> / 2, / 4, ... (down to `smallest`) that fits, or None."""
    value = config.data[key] // 2
    while value >= smallest:
        c = copy.deepcopy(config)
        c.unlock()
        c.data[key] = value
        c.lock()
        if _fits(c, topology, open_keys, scale):
            return value
        value //= 2
    return None


def longest_seq_len(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE,
                    scale: float = memory_model.ACTIVATION_SCALE) -> int | None:
    """The longest of data.seq_len / 2, / 4, ... (down to MIN_SEQ_LEN) that fits, or None."""
    return _halving(config, topology, "seq_len", MIN_SEQ_LEN, open_keys, scale)


def largest_batch(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE) -> int | None:
    """The largest of data.global_batch_size / 2, / 4, ... (down to 1) that fits, or None."""
    return _halving(config, topology, "global_batch_size", 1, open_keys)


def why_nothing_fits(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE) -> str:
    """One sentence: nothing fits, by how much, and the nearest runs that do: a shorter sequence
    on this slice, the smallest slice for this one; where neither, fewer sequences per step on
    the largest slice."""
    need = planner.smallest_memory(config, topology, open_keys)
    gib, d = 2 ** 30, config.data
    text = (f"no candidate fits {topology.name} by the memory model: the smallest needs "
            f"~{(need or 0) / gib:,.0f} GiB per device of {topology.device.hbm_bytes / gib:.0f}")
    ways = []
    shorter = longest_seq_len(config, topology, open_keys)
    if shorter is not None:
        ways.append(f"--seq-len {shorter} fits this slice")
    larger = smallest_slice(config, topology, open_keys)
    if larger is not None:
        ways.append(f"--topology={larger.name} ({larger.num_chips} chips) is the smallest "
                    f"{topology.chip.name} slice that fits {d.global_batch_size} x {d.seq_len:,} tokens")
    if ways:
        return f"{text}; {' and '.join(ways)}."
    largest = ([topology] + list(larger_slices(topology)))[-1]
    batch = largest_batch(config, largest, open_keys)
    if batch is not None:
        return (f"{text}, and neither does a shorter sequence here nor any {topology.chip.name} slice "
                f"up to {largest.name} at {d.global_batch_size} x {d.seq_len:,} tokens; {largest.name} "
                f"fits --config.data.global_batch_size={batch}.")
    return (f"{text}, nor does any {topology.chip.name} slice (up to {largest.name}), any sequence "
            f"down to {MIN_SEQ_LEN:,} tokens or one sequence per step: give a smaller model.")


# ----------------------------------------------------------------------------- a refused compile

# The attention blocks tried, largest first, after a scoped VMEM overflow.
SMALLER_BLOCKS = (1024, 512, 256, 128)


def out_of_memory_advice(config, oom: errors.OutOfMemory, devices) -> str:
    """The nearest change that fits a run whose train step the compiler refused (`oom`: HBM with
    the whole step's bytes per device, or one kernel's scoped VMEM) on `devices`, in words."""
    if oom.memory == errors.SCOPED_VMEM:
        return _smaller_block(config, devices)
    return _nearest_fit(config, oom, devices)


def _valid(config, num_devices: int) -> bool:
    try:
        config_lib.validate(config, num_devices=num_devices)
    except errors.ConfigError:
        return False
    return True


def _changed(config, **keys):
    """`config` with `keys` ("model.remat_policy": value, ...) set."""
    c = copy.deepcopy(config)
    c.unlock()
    for dotted, value in keys.items():
        section, key = dotted.split(".")
        c[section][key] = value
    c.lock()
    return c


def _smaller_block(config, devices) -> str:
    block = config.attention.block_size
    chip = hardware.chip_for_device_kind(devices[0].device_kind)
    tried = planner.block_sizes(chip.name if chip else None)
    for smaller in (b for b in SMALLER_BLOCKS if b < block):
        if _valid(_changed(config, **{"attention.block_size": smaller}), len(devices)):
            return (f"the nearest change that should fit: --config.attention.block_size={smaller} (a kernel's "
                    f"scoped VMEM grows with its block; the blocks the planner tries on this device are {tried})")
    return ("no smaller attention.block_size is valid for these shards: raise the compiler's scoped VMEM limit "
            "(LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=N)")


def _mesh_sizes(config, num_devices: int) -> dict[str, int]:
    """The run's whole (dp, fsdp, sp), slices' axes included, as the memory model takes them."""
    sizes = mesh_lib.resolve_mesh_shape(config.mesh, num_devices)
    return {ax: sizes[ax] * int(config.mesh[f"dcn_{ax}"]) for ax in mesh_lib.MESH_AXES}


def fitted_scale(config, num_devices: int, measured_bytes: int) -> float:
    """The memory model's activation scale that makes it say `measured_bytes` per device for
    `config` (the compiler's figure): what the compiler's copies and padding add, for this step."""
    e = memory_model.per_device_bytes(config, _mesh_sizes(config, num_devices))
    scale = (measured_bytes - e.state_bytes - e.gradient_bytes) / (e.saved_bytes + e.working_bytes)
    return scale if scale > 0 else memory_model.ACTIVATION_SCALE  # (the state alone over it: the fit's own)


def _single_changes(config, num_devices: int):
    """(override, config) of each change that keeps the run's arithmetic, nearest first within
    each kind: attention.residuals=recompute_qkv; the remat policies that keep less, the one
    keeping most first; model.mlp_chunk_size, the largest chunk first; train.grad_accum_steps,
    the fewest micro-batches first."""
    m, d, a = config.model, config.data, config.attention
    sizes = _mesh_sizes(config, num_devices)
    if a.get("residuals", "save_qkv") == "save_qkv":
        yield "--config.attention.residuals=recompute_qkv", _changed(config, **{"attention.residuals": "recompute_qkv"})
    saved = {p: memory_model.per_device_bytes(_changed(config, **{"model.remat_policy": p}), sizes).saved_bytes
             for p in decoder.REMAT_POLICIES}
    for policy in sorted((p for p in saved if saved[p] < saved[m.remat_policy]), key=lambda p: -saved[p]):
        yield f"--config.model.remat_policy={policy}", _changed(config, **{"model.remat_policy": policy})
    shard = d.seq_len // sizes[mesh_lib.SP]
    chunk = min(m.get("mlp_chunk_size") or shard, shard) // 2
    while chunk >= 512:
        if shard % chunk == 0:
            yield f"--config.model.mlp_chunk_size={chunk}", _changed(config, **{"model.mlp_chunk_size": chunk})
        chunk //= 2
    rows = d.global_batch_size // (sizes[mesh_lib.DP] * sizes[mesh_lib.FSDP])
    accum = int(config.train.get("grad_accum_steps", 1)) * 2
    while accum <= rows:
        if d.global_batch_size % (sizes[mesh_lib.DP] * sizes[mesh_lib.FSDP] * accum) == 0:
            yield f"--config.train.grad_accum_steps={accum}", _changed(config, **{"train.grad_accum_steps": accum})
        accum *= 2


def _nearest_fit(config, oom: errors.OutOfMemory, devices) -> str:
    """The first single change (`_single_changes`, then more chips, then a shorter sequence) that the
    memory model, fitted to the compile's figure, puts under HBM_HEADROOM of the device's memory."""
    n = len(devices)
    scale = fitted_scale(config, n, oom.needed)
    budget = planner.HBM_HEADROOM * oom.available
    chip = hardware.chip_for_device_kind(devices[0].device_kind)
    share = None if chip is None else chip.program_share
    basis = "by the memory model fitted to this compile"
    for override, candidate in _single_changes(config, n):
        if not _valid(candidate, n):
            continue
        need = dataclasses.replace(memory_model.per_device_bytes(candidate, _mesh_sizes(candidate, n)),
                                   scale=scale).held_bytes(share)
        if need <= budget:
            return f"the nearest change that fits: {override} (~{errors.byte_size(need)} per device {basis})"
    ways = []
    try:
        topology = auto.topology_of(devices)
    except errors.ConfigError:  # a chip the planner has no figures for: no slices to name
        topology = None
    if topology is not None and topology.num_chips == 1 and topology.chip.torus_dims:
        dims = (1,) * topology.chip.torus_dims  # one chip of a torus: v5e:1x1, v5p:1x1x1
        topology = hardware.Topology(topology.chip, dims, f"{topology.chip.name}:{'x'.join(map(str, dims))}")
    if topology is not None:
        larger = smallest_slice(config, topology, scale=scale)
        if larger is not None:
            ways.append(f"--topology={larger.name} ({larger.num_chips} chips; scripts/plan.py says how to run "
                        "it) is the smallest slice that fits it")
        shorter = longest_seq_len(config, topology, scale=scale)
        if shorter is not None:
            ways.append(f"--config.data.seq_len={shorter} fits these chips")
    if ways:
        return f"no change of a policy, chunk or micro-batches fits ({basis}); {' and '.join(ways)}"
    return (f"no change of a policy, chunk or micro-batches fits ({basis}): run it on more chips or with "
            "fewer tokens per device (scripts/plan.py --topology=... finds the slice)")
