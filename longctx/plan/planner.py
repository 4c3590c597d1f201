"""How to run a config on a slice: every valid (mesh, strategy, layout, residual and remat policy,
block) priced by the step-time model, pruned by the memory model, ranked.

    plan(config, topology) -> [Row, ...]   (best first; each Row holds its config)

A candidate is valid when `config.validate` accepts it (heads against the Ulysses degree, sp
against seq_len, blocks against shards, batch against dp x fsdp: the rules a run would meet), so
the planner proposes nothing a run would refuse. What it does not enumerate stays as the config
has it (model, data, optimizer). A hybrid model (attention.pattern) gets a strategy per layer
type (PerType: every combination the heads allow, halo added for window and chunked types), the
step priced per type (plan/step_time.py), one layout and block for the whole step. Rows within
the model's held-out error of the fastest are a tie (break_ties), ranked by memory headroom,
exposed collectives and the simpler strategy; exact ties go to less memory, then to the order of
the enumeration: the ranking is a pure function of the config and the topology, the same on
every host and at every restart.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import keyword
import time
from typing import Callable

import numpy as np

from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.model import attention as attention_lib
from longctx.model import decoder
from longctx.model import layer_types as layer_types_lib
from longctx.ops import blocks as blocks_lib
from longctx.ops import context_parallel, masks, strategy_schedule, tables
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from longctx.plan import attention_work, chip_points, collectives, hardware, memory_model, step_time

# The blocks a plan tries (the ring's tables and the splash kernel's blocks, on TPU). Blocks of
# 1,024 and 2,048 compile too (ops/splash_kernels.py sets its scoped VMEM limit from the chip),
# and on a v5e chip 1,024 is the fastest at 32,768 tokens (docs/tpu_kernels.md), which
# attention.block_size=auto takes on a chip whose kernels were timed (plan/measured_blocks.py).
# The plan keeps 512 until its published pages are priced again at the larger blocks: the step
# model misprices 2,048's backward (1.6x 1,024's on the chip; docs/planner_calibration.md).
# A shorter shard takes a smaller block (block_choices), and a chip whose kernels were timed
# here tries the blocks its own constants were fitted at (block_sizes).
BLOCK_SIZES = (512,)
# The value of a config key that leaves it to the planner (auto_keys; plan/auto.py at start-up).
AUTO = "auto"
# Fraction of HBM a candidate may use by the memory model, which only prunes (the compile decides).
HBM_HEADROOM = 0.95


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The strategy a row sets (attention.cp and cp_ulysses); what it costs is its `cp`'s."""
    name: str                  # attention.cp
    degree: int | None = None  # attention.cp_ulysses (a strategy that takes a Ulysses degree)

    @property
    def cp(self):
        """The strategy object (ops/strategy.py) the row runs."""
        return context_parallel.named(self.name, self.degree)

    def __str__(self) -> str:
        return str(self.cp)


# The group of a hybrid model's layer types that take attention.cp: those that set no cp of their
# own ("what a type does not set comes from attention.*").
SHARED = "attention"


@dataclasses.dataclass(frozen=True)
class PerType:
    """A hybrid model's strategies: ((group, Strategy), ...), a group being one layer type that
    sets its own cp (attention.layer_types.<name>.cp) or SHARED, every type that takes
    attention.cp; `types` names the layer types of each group, for the table."""
    groups: tuple[tuple[str, Strategy], ...]
    types: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def name(self) -> str:
        return "per_type"

    degree = None

    def by_type(self) -> dict[str, Strategy]:
        members = dict(self.types)
        return {t: strategy for group, strategy in self.groups for t in members[group]}

    def __str__(self) -> str:
        return ", ".join(f"{t} {s}" for t, s in self.by_type().items())


def _group_of(config, name: str) -> str:
    """The group a layer type's strategy is chosen in (PerType): its own where it sets cp."""
    return name if "cp" in _own_settings(config, name) else SHARED


def _own_settings(config, name: str) -> dict:
    types = config.attention.get("layer_types") or {}
    return dict(types[name]) if name in types else {}


def _groups(config) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((group, (type names...)), ...) of a hybrid model, SHARED first where any type is in it."""
    out: dict[str, list[str]] = {}
    for layer_type, _ in collectives.type_layers(config):
        out.setdefault(_group_of(config, layer_type.name), []).append(layer_type.name)
    return tuple(sorted(((g, tuple(t)) for g, t in out.items()), key=lambda x: x[0] != SHARED))


def _configured(config):
    """The strategy the config itself sets: a Strategy, or a PerType for a hybrid model."""
    a = config.attention
    shared = Strategy(attention_lib.cp_name(a), a.get("cp_ulysses"))
    if not layer_types_lib.is_hybrid(config):
        return shared
    groups = _groups(config)
    chosen = []
    for group, _ in groups:
        own = _own_settings(config, group) if group != SHARED else {}
        chosen.append((group, shared if group == SHARED else
                       Strategy(own["cp"], own.get("cp_ulysses", a.get("cp_ulysses")))))
    return PerType(tuple(chosen), groups)


@dataclasses.dataclass
class Row:
    config: object            # the candidate's whole config (ml_collections.ConfigDict)
    mesh: dict[str, int]
    strategy: Strategy
    layout: str
    residuals: str
    remat: str
    block: int
    step: step_time.StepEstimate
    memory: memory_model.MemoryEstimate
    hbm_bytes: int
    program_share: float | None = None  # of temporaries the chip's runtime holds (Chip.program_share)
    tie: bool = False         # within the model's error of the fastest: ranked by break_ties

    @property
    def held_bytes(self) -> int:
        return self.memory.held_bytes(self.program_share)

    @property
    def fits(self) -> bool:
        return self.held_bytes <= HBM_HEADROOM * self.hbm_bytes

    def overrides(self) -> list[str]:
        """The command-line overrides that make the config this row."""
        out = [f"--config.mesh.{a}={n}" for a, n in self.mesh.items()]
        for group, strategy in (self.strategy.groups if isinstance(self.strategy, PerType)
                                else ((SHARED, self.strategy),)):
            prefix = "attention" if group == SHARED else f"attention.layer_types.{group}"
            out += [f"--config.{prefix}.cp={strategy.name}"]
            if strategy.degree is not None or (group != SHARED and "cp_ulysses" in
                                               _own_settings(self.config, group)):
                out += [f"--config.{prefix}.cp_ulysses={strategy.degree}"]
        out += [f"--config.attention.layout={self.layout}",
                f"--config.attention.block_size={self.block}",
                f"--config.attention.residuals={self.residuals}",
                f"--config.model.remat_policy={self.remat}"]
        return out

    def as_dict(self) -> dict:
        per_type = ({t: str(s) for t, s in self.strategy.by_type().items()}
                    if isinstance(self.strategy, PerType) else None)
        return {"mesh": self.mesh, "cp": self.strategy.name, "cp_ulysses": self.strategy.degree,
                "cp_per_layer_type": per_type, "layout": self.layout, "residuals": self.residuals, "remat_policy": self.remat,
                "block_size": self.block, "predicted": self.step.as_dict(),
                "memory_model_bytes": self.memory.total_bytes, "held_bytes": self.held_bytes,
                "hbm_bytes": self.hbm_bytes,
                "fits_by_model": self.fits, "tie": self.tie, "overrides": self.overrides()}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def meshes(config, num_chips: int, open_mesh: bool = True) -> list[dict[str, int]]:
    """(dp, fsdp, sp) splits of the chips: any (open_mesh), else those that keep the axes the
    config fixes (the -1 axes are free: a config with cp=auto may leave several at -1)."""
    fixed = {} if open_mesh else {a: int(config.mesh[a]) for a in ("dp", "fsdp", "sp")
                                  if int(config.mesh[a]) != -1}
    out = []
    for sp in _divisors(num_chips):
        for dp in _divisors(num_chips // sp):
            m = {"dp": dp, "fsdp": num_chips // sp // dp, "sp": sp}
            if all(m[a] == n for a, n in fixed.items()):
                out.append(m)
    return out


def strategies(config, sp: int, local: bool = False) -> list[Strategy]:
    """The strategies that split the model's heads over `sp` devices (ops.context_parallel's
    candidates, in its order), those offered only to window and chunked layers where `local`;
    the default alone where there is nothing to split (sp = 1)."""
    if sp == 1:
        return [Strategy(context_parallel.DEFAULT)]
    return [Strategy(s.name, s.degree) for s in context_parallel.candidates(config.model.num_heads, sp)
            if local or not s.local_masks_only]


def _layouts(strategy, documents: bool) -> tuple[str, ...]:
    # A strategy whose work the layout does not change (Ulysses: every device computes the whole
    # sequence) needs one. The layout is one for all layers: a hybrid's is chosen for the step.
    # With documents to price it on, the per-document layout is a candidate too.
    chosen = ([s for _, s in strategy.groups] if isinstance(strategy, PerType) else [strategy])
    if not any(s.cp.layout_matters for s in chosen):
        return ("contiguous",)
    return layout_lib.LAYOUTS + (layout_lib.ROW_LAYOUTS if documents else ())


def _local(attention) -> bool:
    """A type whose mask reaches only near keys (a window or chunks): the halo may pay for it."""
    return attention.get("sliding_window") is not None or attention.get("chunk_size") is not None


def per_type_strategies(config, sp: int, open_groups=None) -> list[PerType]:
    """A hybrid model's candidate strategies: every combination of one per group (PerType), each
    group's from `strategies` plus halo where one of its types is local, those in `open_groups`
    (None: all) chosen and the rest as the config sets them. A row must be one a command line
    can give (scripts/plan.py compiles it with its overrides): a type named like a Python keyword
    (`global`) cannot be named on one, so its own cp stays; usp needs a cp_ulysses key to set,
    in the type's settings for a type of its own, and in every type that sets its own cp for
    SHARED (else that type would inherit the degree)."""
    groups = _groups(config)
    configured = dict(_configured(config).groups)
    resolved = {t.name: t.attention for t, _ in collectives.type_layers(config)}
    own_degree = {g: "cp_ulysses" in _own_settings(config, g) for g, _ in groups if g != SHARED}
    options = []
    for group, members in groups:
        if (open_groups is not None and group not in open_groups) or keyword.iskeyword(group):
            options.append([configured[group]])
            continue
        degree_ok = all(own_degree.values()) if group == SHARED else own_degree[group]
        local = any(_local(resolved[t]) for t in members)
        options.append([s for s in strategies(config, sp, local)
                        if degree_ok or not s.cp.takes_degree])
    return [PerType(tuple(zip((g for g, _ in groups), combo)), groups)
            for combo in itertools.product(*options)]


def candidate_config(config, mesh, strategy, layout, residuals, remat, block):
    c = copy.deepcopy(config)
    c.unlock()
    c.mesh.update(dp=mesh["dp"], fsdp=mesh["fsdp"], sp=mesh["sp"])
    c.attention.update(layout=layout, block_size=block, residuals=residuals)
    for group, s in (strategy.groups if isinstance(strategy, PerType) else ((SHARED, strategy),)):
        if group == SHARED:
            c.attention.update(cp=s.name, cp_ulysses=s.degree)
        else:
            own = c.attention.layer_types[group]
            own.cp = s.name
            if "cp_ulysses" in own or s.degree is not None:
                own.cp_ulysses = s.degree
    c.model.remat_policy = remat
    c.lock()
    return c


# What a plan may choose ("mesh": every split of the chips, not only the -1 axes). scripts/plan.py
# searches all of them; `auto` at start-up only those the config leaves to it (auto_keys).
SEARCHABLE = ("mesh", "attention.cp", "attention.layout", "attention.block_size",
              "attention.residuals", "model.remat_policy")


def auto_keys(config) -> tuple[str, ...]:
    """The keys a run's config leaves to the planner: attention.cp=auto (and with it
    attention.layout=auto), attention.block_size=auto. The mesh's -1 axes are free in every plan;
    so is attention.layout=auto, which a candidate must fix to be priced, so a run that asks the
    planner for its block also runs the planner's layout."""
    a = config.attention
    own = [dict(t).get("cp") for t in (a.get("layer_types") or {}).values()]
    keys = ("attention.cp",) if AUTO in [attention_lib.cp_name(a), *own] else ()
    if keys and a.layout == AUTO:
        keys += ("attention.layout",)
    if a.block_size == AUTO:
        keys += ("attention.block_size",)
    return keys


def plan(config, topology: hardware.Topology, *, open_keys=SEARCHABLE,
         segment_ids: np.ndarray | Callable[[int, int], np.ndarray] | None = None,
         progress: Callable[[int, int, int, int], None] | None = None) -> list[Row]:
    """Every valid candidate, best first (fitting ones by predicted step time, then the rest;
    `distinct` keeps the best of each way to split attention, for a table).

    open_keys: the SEARCHABLE keys to choose; the others stay as the config has them.
    segment_ids: natural-order rows of the run's packed documents [rows, seq_len] to price the
    attention by, or `(sp, block) -> those rows` as a run of that sp and attention.block_size packs
    them (data.pipeline.PackedSample: shard_balanced's rows follow both), each candidate priced on
    its own (None: the static mask, rows of one document).
    progress: called after each valid (mesh, strategy, layout, block) with (done, total, document
    tables built, total): with documents at 2,097,152 tokens a plan takes minutes, nearly all of
    them in the ring's tables on the documents (one per layout, sp and block, which every strategy
    shares), so the caller can say how far it is in both."""
    a, m = config.attention, config.model
    chips = topology.num_devices  # a mesh's size: TPU7x's chips are two devices each
    opened = lambda key, values, current: tuple(values) if key in open_keys else (current,)  # noqa: E731
    residual_choices = opened("attention.residuals", _residual_policies(topology), a.residuals)
    remat_choices = opened("model.remat_policy", decoder.REMAT_POLICIES, m.remat_policy)
    sample = _sample(segment_ids)
    pairs = {}  # MFU's document pairs per sample (by its identity: `sample` holds every one)
    documents = segment_ids is not None and bool(a.use_segment_ids)
    valid = [(mesh, strategy, layout, block) for mesh, strategy, layout, block
             in _combinations(config, topology, open_keys, documents)
             if _valid(candidate_config(config, mesh, strategy, layout, a.residuals, m.remat_policy,
                                        block), chips)]
    kinds = len({str(masks.make_mask_spec(**attention_lib.mask_kwargs(t.attention)))
                 for t, _ in collectives.type_layers(config)})
    tables = 0 if segment_ids is None else kinds * len({
        (layout, mesh["sp"], block, batch_rows(config, mesh, sample(mesh["sp"], block)))
        for mesh, _, layout, block in valid})
    rows = []
    ring_schedules = {}  # with documents: _schedule's ring schedules per (mask, layout, sp, block, batch)
    schedules = {}  # each layer type's: per (strategy, mask, layout, sp, block)
    for done, (mesh, strategy, layout, block) in enumerate(valid, 1):
        ids = None if sample is None else sample(mesh["sp"], block)  # the rows this run packs
        if ids is not None and id(ids) not in pairs:
            pairs[id(ids)] = step_time.document_pairs(config, ids)
        schedule = _type_schedules(candidate_config(config, mesh, strategy, layout, a.residuals,
                                                    m.remat_policy, block),
                                   ids, ring_schedules, schedules)
        for residuals, remat in itertools.product(residual_choices, remat_choices):
            cc = candidate_config(config, mesh, strategy, layout, residuals, remat, block)
            rows.append(Row(cc, mesh, strategy, layout, residuals, remat, block,
                            step_time.estimate(cc, topology, schedule, mesh,
                                               rows_in_schedule=batch_rows(config, mesh, ids),
                                               pairs_per_row=None if ids is None else pairs[id(ids)]),
                            memory_model.per_device_bytes(cc, mesh),
                            topology.device.hbm_bytes, topology.device.program_share))
        if progress is not None:
            progress(done, len(valid), len(ring_schedules), tables)
    order = {id(r): i for i, r in enumerate(rows)}
    return break_ties(sorted(rows, key=lambda r: (not r.fits, round(r.step.seconds, 9),
                                                  r.held_bytes, order[id(r)])))


# Memory-model bytes under this share of HBM leave room for what the model misses (it errs by up
# to 22% on the compiles, docs/planner_calibration.md): the tie rule's first key.
COMFORTABLE_HBM = 0.8


def simplicity(strategy) -> int:
    """The least simple of a row's strategies, by their own `simplicity` (ops/strategy.py: how
    much their price rests on; the tie rule's last key before time)."""
    groups = strategy.groups if isinstance(strategy, PerType) else ((SHARED, strategy),)
    return max(s.cp.simplicity for _, s in groups)


def break_ties(rows: list[Row], margin: float = step_time.HELD_OUT_ERROR) -> list[Row]:
    """`rows` (fitting first, fastest first) with the fitting rows whose predicted step is within
    `margin` (the model's held-out error) of the fastest marked a tie and ranked by what the
    model knows better than a few percent of time: memory headroom (under COMFORTABLE_HBM of HBM
    by the memory model first), fewer exposed collective seconds (to 1% of the fastest step),
    the simpler strategy (SIMPLICITY), then time."""
    fitting = [r for r in rows if r.fits]
    if len(fitting) < 2:
        return rows
    best = fitting[0].step.seconds
    tied = [r for r in fitting if r.step.seconds <= best * (1.0 + margin)]
    if len(tied) < 2:
        return rows
    for r in tied:
        r.tie = True
    ranked = sorted(tied, key=lambda r: (r.held_bytes > COMFORTABLE_HBM * r.hbm_bytes,
                                         round(r.step.exposed_communication / best, 2),
                                         simplicity(r.strategy), r.step.seconds))
    chosen = {id(r) for r in tied}
    return ranked + [r for r in rows if id(r) not in chosen]


def _valid(candidate, chips: int) -> bool:
    """config.validate accepts it: the planner proposes nothing a run would refuse."""
    try:
        config_lib.validate(candidate, num_devices=chips)
    except ConfigError:
        return False
    return True


def _combinations(config, topology: hardware.Topology, open_keys, documents: bool = False) -> list[tuple]:
    """(mesh, strategy, layout, block) of every candidate before validation, in the order the
    ranking breaks ties by; `documents`: the plan prices packed documents (per-row layouts)."""
    a = config.attention
    hybrid = layer_types_lib.is_hybrid(config)
    out = []
    for mesh in meshes(config, topology.num_devices, open_mesh="mesh" in open_keys):
        if "attention.cp" not in open_keys:
            candidates = [_configured(config)]
        elif hybrid:
            candidates = per_type_strategies(config, mesh["sp"], _open_groups(config))
        else:
            candidates = strategies(config, mesh["sp"])
        for strategy in candidates:
            layouts = (_layouts(strategy, documents) if "attention.layout" in open_keys or a.layout == AUTO
                       else (a.layout,))
            for layout in layouts:
                blocks = (block_choices(config, mesh["sp"], layout, topology.chip.name)
                          if "attention.block_size" in open_keys else (a.block_size,))
                out += [(mesh, strategy, layout, block) for block in blocks]
    return out


def _open_groups(config):
    """The PerType groups a plan chooses: all (None) for scripts/plan.py; under attention.cp=auto
    SHARED and the types that set cp=auto themselves (a type's own strategy is the user's)."""
    if attention_lib.cp_name(config.attention) != AUTO:
        return None
    return {SHARED} | {g for g, _ in _groups(config)
                       if g != SHARED and _own_settings(config, g).get("cp") == AUTO}


def smallest_memory(config, topology: hardware.Topology, open_keys=SEARCHABLE,
                    scale: float = memory_model.ACTIVATION_SCALE) -> int | None:
    """The fewest bytes per chip any valid candidate needs by the memory model (what the chip
    must hold: MemoryEstimate.held_bytes; None: no candidate is valid); stops at the first that
    fits. The memory model alone (which the layout
    and the block do not change: one valid of each mesh and strategy is priced), no step time:
    fast enough to ask of many slices and lengths (plan/fit_remedy.py). `scale`: the model's
    activation scale (MemoryEstimate.scale; fit_remedy fits it to a compile's own figure)."""
    a, m = config.attention, config.model
    residual_choices = (_residual_policies(topology) if "attention.residuals" in open_keys
                        else (a.residuals,))
    remat_choices = decoder.REMAT_POLICIES if "model.remat_policy" in open_keys else (m.remat_policy,)
    best, priced = None, set()
    for mesh, strategy, layout, block in _combinations(config, topology, open_keys):
        key = (tuple(mesh.values()), strategy)
        if key in priced:
            continue
        c = candidate_config(config, mesh, strategy, layout, a.residuals, m.remat_policy, block)
        if not _valid(c, topology.num_devices):
            continue
        priced.add(key)
        c.unlock()
        for residuals, remat in itertools.product(residual_choices, remat_choices):
            c.attention.residuals, c.model.remat_policy = residuals, remat
            need = dataclasses.replace(memory_model.per_device_bytes(c, mesh), scale=scale
                                       ).held_bytes(topology.device.program_share)
            best = need if best is None else min(best, need)
            if best <= HBM_HEADROOM * topology.device.hbm_bytes:
                return best
    return best


def block_sizes(chip: str | None = None) -> tuple[int, ...]:
    """The blocks a plan tries on a device of `chip` (hardware.Chip.name): on a chip whose own
    kernel constants were fitted on its timings (step_time.chip_constant), the blocks they were
    fitted at (chip_points.FIT_KERNEL), where the plan's price of each block is measured (a v5e
    chip runs 1,024 faster than 512); BLOCK_SIZES elsewhere."""
    if step_time.has_own_kernel_constants(chip):
        return tuple(chip_points.FIT_KERNEL["block"])
    return BLOCK_SIZES


def block_choices(config, sp: int, layout: str, chip: str | None = None) -> tuple[int, ...]:
    """The blocks a plan tries on shards of seq_len / sp tokens: block_sizes(chip), or where the
    shards are too short for every one of them (the tiny preset's 256 tokens), the largest block
    below that the ring accepts there (ops/blocks.py, as config.validate and the kernel rule), so
    that a short sequence gets a block rather than no candidate."""
    a, seq_len, sizes = config.attention, config.data.seq_len, block_sizes(chip)
    if seq_len % sp:
        return sizes  # no shard: config.validate refuses the mesh with its own sentence
    shard = seq_len // sp
    if any(blocks_lib.block_problem(b, shard, a.impl) is None for b in sizes):
        return sizes
    fit = blocks_lib.fit_block(min(sizes), shard, a.impl, layout)
    return sizes if fit is None else (fit,)


def fallback_block(config, num_devices: int) -> int:
    """The block to set where the planner cannot choose one (a chip it has no figures for): the
    smallest of block_choices that the config's shards accept (the one a plan leans to), on the
    config's sp (all the devices where sp is not fixed)."""
    try:
        sp = mesh_lib.resolve_mesh_shape(config.mesh, num_devices)["sp"]
    except ValueError:  # several axes left at -1 (cp=auto): the ring over every device is the worst case
        sp = int(config.mesh.sp) if int(config.mesh.sp) > 0 else num_devices
    shard = config.data.seq_len // sp
    choices = block_choices(config, sp, config.attention.layout)
    return next((b for b in choices if blocks_lib.block_problem(b, shard, config.attention.impl) is None),
                choices[0])


# How often a long plan says how far it is (plan's `progress`, on stderr).
PROGRESS_EVERY_S = 10.0


def progress_lines(out, every: float = PROGRESS_EVERY_S,
                   clock=time.monotonic) -> Callable[[int, int, int, int], None]:
    """A `progress` for plan() that writes a line to `out` when `every` seconds have passed since
    the last (or the start): a plan that ends sooner says nothing."""
    start = last = clock()

    def report(done: int, total: int, tables: int, tables_total: int) -> None:
        nonlocal last
        now = clock()
        if now - last >= every:
            last = now
            built = f", the documents' block tables {tables} of {tables_total}" if tables_total else ""
            print(f"plan: {done} of {total} (mesh, strategy, layout, block) priced{built}, "
                  f"{now - start:.0f} s", file=out, flush=True)

    return report


def distinct(rows: list[Row]) -> list[Row]:
    """The first (fastest, then smallest) row of each sp size, strategy and layout: the table
    lists the ways to split attention, each with the dp x fsdp split, block and policies that
    suit it best, not every variant of each (which differ by a fraction of a percent)."""
    seen, out = set(), []
    for r in rows:
        key = (r.mesh["sp"], r.strategy, r.layout)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _residual_policies(topology: hardware.Topology) -> tuple[str, ...]:
    """The residual policies a plan may choose: on TPU not offload_qkv, whose whole step this
    libtpu's compiler aborts on (plan/aot.py, OFFLOAD_ON_TPU)."""
    if topology.chip.torus_dims:
        return tuple(p for p in attention_lib.RESIDUAL_POLICIES if p != "offload_qkv")
    return attention_lib.RESIDUAL_POLICIES


def batch_rows(config, mesh: dict[str, int], segment_ids) -> int:
    """How many sampled rows one priced batch holds: the rows one sp group holds
    (global_batch / (dp x fsdp)), at most the sample; 1 without documents (rows of one document
    are all alike)."""
    if segment_ids is None:
        return 1
    held = max(1, config.data.global_batch_size // (mesh["dp"] * mesh["fsdp"]))
    return min(held, int(segment_ids.shape[0]))


def _sample(segment_ids) -> Callable[[int, int], np.ndarray] | None:
    """plan's `segment_ids` as `(sp, block) -> rows`, each distinct result held (so that its
    identity keys the caches for the whole plan): one array serves every candidate."""
    if segment_ids is None:
        return None
    if not callable(segment_ids):
        rows = np.asarray(segment_ids)
        return lambda sp, block: rows
    held: dict[tuple[int, int], np.ndarray] = {}

    def sample(sp: int, block: int) -> np.ndarray:
        if (sp, block) not in held:
            held[(sp, block)] = np.asarray(segment_ids(sp, block))
        return held[(sp, block)]

    return sample


def _type_schedules(candidate, segment_ids, ring_schedules: dict, schedules: dict) -> dict:
    """{layer type: its strategy's schedule} of a candidate config, each type with its own mask,
    strategy and block, made once per (strategy, mask, layout, sp, block, batch, sample) into
    `schedules`. With documents (`segment_ids`: the rows the candidate's run packs), a
    step_time.BatchMean of the sample's batches of the rows one sp group holds (batch_rows)."""
    a, sp = candidate.attention, int(candidate.mesh.sp)
    rows = batch_rows(candidate, dict(candidate.mesh), segment_ids)
    out = {}
    for layer_type, _ in collectives.type_layers(candidate):
        t = layer_type.attention
        chosen = attention_lib.strategy_of(t)
        spec = masks.make_mask_spec(**attention_lib.mask_kwargs(t))
        key = (chosen, spec, a.layout, sp, int(t.block_size), rows, id(segment_ids))
        if key not in schedules:
            schedules[key] = _schedule(chosen, spec, a.layout, candidate.data.seq_len, sp,
                                       int(t.block_size), segment_ids, rows, ring_schedules)
        out[layer_type.name] = schedules[key]
    return out


def _schedule(strategy, spec, layout, seq_len, sp, block, segment_ids, rows: int,
              ring_schedules: dict):
    """The strategy's schedule. With documents, the mean over the sample's batches of `rows`
    rows (what one sp group holds: each batch waits for its own busiest device at every ring
    step and stops where its own documents do), each from the ring's on that batch, which every
    strategy and every mesh with this mask, layout, sp, block and batch shares (computed once
    into `ring_schedules`), without the element-wise count of kept blocks, which a plan does not
    read."""
    if segment_ids is None:
        return attention_work.static_schedule(strategy, spec, layout, seq_len, sp, block)
    key = (spec, layout, sp, block, rows, id(segment_ids))  # the sample: plan's `_sample` holds it
    if key not in ring_schedules:
        ring_schedules[key] = [tables.document_schedule(spec, layout, seq_len, sp, block,
                                                        segment_ids[i:i + rows], count_kept=False)
                               for i in range(0, len(segment_ids) - rows + 1, rows)]
    return step_time.BatchMean(tuple(
        strategy_schedule.from_ring_schedule(strategy, ring, spec, layout, seq_len, sp, block)
        for ring in ring_schedules[key]))
