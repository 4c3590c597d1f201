"""What to change when no candidate of a plan fits: the nearest run that does, by the memory model.

    why_nothing_fits(config, topology) -> one sentence (for scripts/plan.py's exit 2)

Two ways out, each the smallest change of one thing: the smallest slice of the same chip that
fits the config as it is (the slice grown one axis doubling at a time, the shortest axis first,
as TPU slices come), and the longest sequence that fits this slice (data.seq_len halved). Only
the memory model decides (planner.smallest_memory, no step time), which is what a plan prunes
by; the compile of the plan that follows is the check.
"""

from __future__ import annotations

import copy

from longctx.plan import hardware, planner

# The largest slice of each chip (cloud.google.com/tpu/docs, each version's system architecture
# page: v4 4,096 chips, v5e and v6e 256, v5p 8,960, TPU7x 9,216); GPUs: as many as the search goes.
MAX_CHIPS = {"v4": 4096, "v5e": 256, "v5p": 8960, "v6e": 256, "tpu7x": 9216}
MAX_GPUS = 16_384
# The shortest sequence the search tries.
MIN_SEQ_LEN = 1024


def _fits(config, topology: hardware.Topology, open_keys) -> bool:
    need = planner.smallest_memory(config, topology, open_keys)
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


def smallest_slice(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE):
    """The first of larger_slices that some candidate fits, or None."""
    return next((t for t in larger_slices(topology) if _fits(config, t, open_keys)), None)


def _halving(config, topology, key: str, smallest: int, open_keys) -> int | None:
    """The largest of data.<key> / 2, / 4, ... (down to `smallest`) that fits, or None."""
    value = config.data[key] // 2
    while value >= smallest:
        c = copy.deepcopy(config)
        c.unlock()
        c.data[key] = value
        c.lock()
        if _fits(c, topology, open_keys):
            return value
        value //= 2
    return None


def longest_seq_len(config, topology: hardware.Topology, open_keys=planner.SEARCHABLE) -> int | None:
    """The longest of data.seq_len / 2, / 4, ... (down to MIN_SEQ_LEN) that fits, or None."""
    return _halving(config, topology, "seq_len", MIN_SEQ_LEN, open_keys)


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
