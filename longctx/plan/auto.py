"""`attention.cp=auto`, `attention.block_size=auto`: the planner's choice applied to a run's config
when it starts.

    resolution = resolve(config, devices)   # .config to run, .chosen row, .rows best first

With attention.cp=auto the planner chooses the strategy (and its Ulysses degree), the mesh's -1
axes (several may be -1 under auto) and attention.layout=auto; with attention.block_size=auto the
block: on a chip whose kernels were timed, the block measured fastest for the run's mask at the
nearest shard length (plan/measured_blocks.py), else the planner's (planner.BLOCK_SIZES), and the
layout too where it is auto. It chooses among the candidates
the config leaves open (planner.auto_keys), by the predicted step time of those the memory model
fits. Everything else stays as configured.
The choice depends only on the config and the devices' kind and count, so every host of a run
makes the same one, and a restart makes it again. Scripts resolve before the run starts
(scripts/train.py, estimate.py); longctx.train, which sits below the planner, never sees "auto"
(config.validate refuses either with the way out).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from longctx.errors import ConfigError
from longctx.ops import blocks as blocks_lib
from longctx.parallel import mesh as mesh_lib
from longctx.plan import hardware, measured_blocks, planner

AUTO = planner.AUTO


def _instead(key: str, config, num_devices: int) -> str:
    """What to set instead of an auto key, where the planner has no figures for the chip: a value
    config.validate then accepts (the block fits the config's shards)."""
    if key.endswith(".cp"):  # attention.cp or a layer type's
        return f"--config.{key}=ring (or all_gather, ulysses, usp)"
    if key == "attention.layout":
        return "--config.attention.layout=auto (the ring's own choice)"
    block = planner.BLOCK_SIZES[0] if config is None else planner.fallback_block(config, num_devices)
    return f"--config.attention.block_size={block}"


def _named(keys, config) -> list[str]:
    """`keys` with attention.cp as the keys set to auto that ask for it (attention.cp, a layer
    type's attention.layer_types.<name>.cp), each of which the fix must set."""
    if config is None or "attention.cp" not in keys:
        return list(keys)
    a = config.attention
    cp = (["attention.cp"] if a.get("cp") == AUTO else []) + [
        f"attention.layer_types.{name}.cp" for name, settings in sorted((a.get("layer_types") or {}).items())
        if dict(settings).get("cp") == AUTO]
    return [named for key in keys for named in (cp or [key] if key == "attention.cp" else [key])]


def topology_of(devices, asked=("attention.cp",), config=None) -> hardware.Topology:
    """The slice `devices` form: their chip and the extent of their coordinates (TPU), or a
    switch of n devices (GPU). ConfigError, naming the `asked` auto keys (and what to set
    instead, for `config`), where the planner knows no such chip."""
    kind = devices[0].device_kind
    chip = hardware.chip_for_device_kind(kind)
    if chip is None:
        known = ", ".join(hardware.CHIPS)
        keys = [k for k in _named(asked, config) if k != "attention.layout"]  # layout=auto runs without the planner
        raise ConfigError(f"{' and '.join(f'{k}=auto' for k in keys)} "
                          f"need{'s' if len(keys) == 1 else ''} the step-time model's figures for "
                          f"the chip, and longctx has none for {devices[0].platform} devices "
                          f"({kind!r}; it knows {known}): set "
                          f"{' and '.join(_instead(k, config, len(devices)) for k in keys)}.")
    coords = [getattr(d, "coords", None) for d in devices]
    if chip.torus_dims and all(c is not None for c in coords):
        chips = {tuple(c) for c in coords}
        extent = tuple(int(n) for n in np.ptp(np.array(sorted(chips)), axis=0) + 1)
        shape = tuple(n for n in extent if n > 1) or (1,)
    else:
        shape = (len(devices),)
    return hardware.Topology(chip, shape, f"{chip.name}:{'x'.join(map(str, shape))}")


@dataclasses.dataclass
class Resolution:
    config: object                   # the config to run, nothing left to auto
    chosen: planner.Row | None       # the planner's row it is (None: nothing was asked)
    rows: list                       # the planner's rows, best first
    asked: tuple = ()                # the keys left to the planner (planner.auto_keys)
    measured: str | None = None      # how a measured block was chosen (measured_blocks)

    def run_info(self, rows: int = 5) -> dict:
        """What run_info.json records: the choice's predicted step and the best rows."""
        if self.chosen is None:
            return {}
        return {"plan": {"chosen": self.chosen.as_dict(),
                         "rows": [r.as_dict() for r in self.rows[:rows]]}}


def resolve(config, devices) -> Resolution:
    """The config with its auto keys resolved (as it is when it asks for nothing)."""
    config, measured = _measured_block(config, devices)
    keys = planner.auto_keys(config)
    if not keys:
        return Resolution(config, None, [], measured=measured)
    topology = topology_of(devices, keys, config)
    rows = planner.plan(config, topology, open_keys=keys)
    fitting = [r for r in rows if r.fits]
    if not fitting:
        best = min(rows, key=lambda r: r.held_bytes, default=None)
        need = "" if best is None else (f" (the smallest needs ~{best.held_bytes / 2**30:.0f} "
                                        f"GiB of {best.hbm_bytes / 2**30:.0f})")
        asked = ", ".join(f"{k}=auto" for k in keys)
        raise ConfigError(f"{asked}: no candidate fits {topology.name} by the memory model{need}: "
                          f"run scripts/plan.py to see what does, or set the keys yourself.")
    return Resolution(fitting[0].config, fitting[0], rows, keys, measured)


def _measured_block(config, devices):
    """(config, description): attention.block_size=auto set to the block measured fastest on
    these devices' chip, where it was timed for the run's mask kind; else the config as it is
    and None. The mesh's sp (for the shard length) must be known: with -1 axes, the planner
    chooses the block with them."""
    a = config.attention
    if a.get("block_size") != AUTO or a.get("impl", "splash") != "splash":
        return config, None
    try:
        sp = mesh_lib.resolve_mesh_shape(config.mesh, len(devices))[mesh_lib.SP]
    except ValueError:  # several -1 axes (under cp=auto): the planner picks the block with them
        return config, None
    shard_len = config.data.seq_len // sp
    kind = devices[0].device_kind
    found = measured_blocks.best_block(
        kind, measured_blocks.mask_kind(a), shard_len,
        lambda b: blocks_lib.block_problem(b, shard_len, "splash") is None,
        head_dim=config.model.head_dim, group=config.model.num_heads // config.model.num_kv_heads)
    if found is None:
        return config, None
    config = copy.deepcopy(config)  # as the planner's candidates are made: the field keeps its type
    with config.unlocked():
        config.attention.update(block_size=found.block)
    return config, found.describe(kind)


def prediction(config, devices) -> dict | None:
    """The planner's figures for `config` as it is (no choice), for run_info.json, so that a run
    on real hardware can be held against them; None on devices the planner has no figures for."""
    try:
        topology = topology_of(devices)
    except ConfigError:
        return None
    rows = planner.plan(config, topology, open_keys=())
    return rows[0].as_dict() if rows else None


def describe(resolution: Resolution) -> str:
    """The start-up line of an auto choice: what was asked, what was chosen, the predicted step
    (and how a measured block was chosen, on a line before)."""
    if resolution.chosen is None:
        return resolution.measured or ""
    if resolution.measured:
        return resolution.measured + "\n" + describe(dataclasses.replace(resolution, measured=None))
    row, asked = resolution.chosen, ", ".join(f"{k}=auto" for k in resolution.asked)
    mesh = ", ".join(f"{a}={n}" for a, n in row.mesh.items())
    return (f"{asked}: the planner chose {row.strategy} ({row.layout}, mesh {mesh}, block "
            f"{row.block}); predicted step {row.step.seconds:.3g} s, MFU {row.step.mfu:.0%}, "
            f"{row.step.bound}-bound")
