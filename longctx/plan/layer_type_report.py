"""The schedule report per layer type: what each type of a model's period costs around the sp ring.

A hybrid model (attention.pattern, longctx/model/layer_types.py) runs each layer type with its own
mask, block size and strategy, so one ring report of `attention.*` says nothing about most of its
layers. Per type this gives: how many layers have it, the ring steps its mask runs, the blocks its
own strategy computes (all devices) and the slowest device's path through them, and the K/V bytes
one device sends per layer in the forward and the backward, for every strategy by the closed form
(collectives.layer_type_traffic) and, for the type's own strategy, read from the lowered program's
collectives when a mesh of (abstract TPU) devices is given. scripts/ring_report.py --config prints
it; docs/hybrid_traffic.md holds Gemma 3's.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from longctx import reports
from longctx.errors import ConfigError
from longctx.model import attention as attention_lib
from longctx.model import layer_types
from longctx.ops import context_parallel, halo, masks, strategy_schedule
from longctx.plan import collectives


@dataclasses.dataclass(frozen=True)
class TypeReport:
    name: str
    layers: int  # the model's layers of this type
    mask: str  # e.g. "causal, window 1024"
    strategy: str  # the type's own (attention.cp; "usp U=2")
    block: int
    ring_steps: tuple[int, ...]  # the ring steps its mask runs
    halo_offsets: tuple[int, ...]  # the ring offsets halo receives a hull from (one permute each)
    steps: str  # what its own strategy's K/V go through ("16 ring steps", "halo offsets [1]")
    computed_blocks: float  # by its own strategy, summed over devices and rows
    critical_path: float  # blocks on the slowest device's path
    formula: dict  # strategy label -> {"forward", "backward"} bytes one device sends per layer
    lowered: dict | None = None  # {"forward", "backward"} of its own strategy, from the program

    @property
    def sent(self) -> dict:
        """Its own strategy's bytes by the closed form."""
        return self.formula[self.strategy]


def describe_mask(attention) -> str:
    """A type's mask in words: "causal, window 1024", "chunked 8192", "causal, sinks, soft cap 50"."""
    parts = ["causal" if attention.causal else "bidirectional"]
    if attention.sliding_window is not None:
        parts.append(f"window {attention.sliding_window}")
    if attention.chunk_size is not None:
        parts.append(f"chunked {attention.chunk_size}")
    if attention.get("attention_sinks"):
        parts.append("sinks")
    if attention.get("soft_cap"):
        parts.append(f"soft cap {attention.soft_cap:g}")
    return ", ".join(parts)


def type_reports(config, *, sp: int, layout: str, segment_ids: np.ndarray, rows: int = 1,
                 mesh: jax.sharding.Mesh | None = None) -> list[TypeReport]:
    """One TypeReport per layer type of `config`'s period, in pattern order.

    `segment_ids`: natural-order rows [r, S] of packed documents (0 padding) the schedules are
    worked out on, for types that mask documents; `rows`: sequences per device (the bytes scale
    with them). `mesh`: an "sp" mesh of `sp` devices to lower each type's attention on (nothing
    compiles; abstract TPU devices read what the TPU program sends)."""
    traffic = collectives.layer_type_traffic(config, sp=sp, rows=rows, layout=layout)
    seq_len = config.data.seq_len
    types = collections.OrderedDict((t.name, t) for t in layer_types.period(config))
    out = []
    for name, layer_type in types.items():
        a, t = layer_type.attention, traffic[name]
        if attention_lib.cp_name(a) not in context_parallel.STRATEGIES:
            raise ConfigError(f"attention.layer_types.{name}.cp={attention_lib.cp_name(a)!r}: the "
                              "report needs a strategy (resolve cp=auto first: scripts/plan.py "
                              "chooses one).")
        chosen = attention_lib.strategy_of(a)
        kw = attention_lib.mask_kwargs(a)
        spec = masks.make_mask_spec(**kw)
        if spec.chunk is not None and a.use_segment_ids:
            # chunks start at each document's start: statically, the window of chunk - 1 keys
            # they span, as the kernels are given it (and as layer_type_traffic prices it)
            spec = masks.within_chunk_window(spec)
        block = min(int(a.block_size), seq_len // sp)
        ids = segment_ids if a.use_segment_ids else np.ones((1, seq_len), np.int32)
        schedule = strategy_schedule.strategy_schedule(chosen, spec, layout, seq_len, sp, block, ids,
                                                       count_kept=False)
        shape = collectives.type_shape(config, a, sp, max(1, rows))
        cfg = collectives.layer_config(shape, causal=spec.causal, sliding_window=spec.window,
                                       chunk_size=spec.chunk, layout=layout, block=block)
        lowered = None
        if mesh is not None:
            sent = collectives.attention_traffic(
                mesh, shape, chosen.name, chosen.degree, impl="splash", layout=layout,
                block_sizes=block, skip_documents=False, **kw)
            lowered = {part: traffic_.total_sent for part, traffic_ in sent.items()}
        out.append(TypeReport(name=name, layers=t.layers, mask=describe_mask(a), strategy=t.chosen,
                              block=block, ring_steps=tuple(cfg.tables.run_steps),
                              halo_offsets=tuple(ex.offset for ex in halo.exchanges(cfg)),
                              steps=chosen.steps_in_words(cfg),
                              computed_blocks=float(schedule.computed_blocks),
                              critical_path=float(schedule.critical_path),
                              formula=t.per_strategy, lowered=lowered))
    return out


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:,.1f}"


def markdown(found: list[TypeReport], topology: str | None = None) -> str:
    """Two tables: each type on its own strategy (schedule, bytes by formula and, with a
    topology, from the lowered program), then every strategy's bytes per type, the own marked;
    and the step's K/V bytes per device against every layer on the ring."""
    lowered = [f"lowered {topology} fwd / bwd MiB"] if topology else []
    rows = []
    for r in found:
        rows.append([r.name, r.layers, r.mask, r.strategy, r.block, r.steps, f"{r.computed_blocks:,.0f}",
                     f"{r.critical_path:,.0f}", f"{_mib(r.sent['forward'])} / {_mib(r.sent['backward'])}"]
                    + ([f"{_mib(r.lowered['forward'])} / {_mib(r.lowered['backward'])}"] if r.lowered else []))
    own = reports.table(["layer type", "layers", "mask", "strategy", "block", "steps", "blocks computed",
                  "critical path", "formula fwd / bwd MiB"] + lowered, rows)
    labels = list(dict.fromkeys(label for r in found for label in r.formula))
    every = reports.table(["layer type"] + [f"{label} MiB" for label in labels],
                   [[r.name] + [("**" if label == r.strategy else "")
                                + (_mib(sum(r.formula[label].values())) if label in r.formula else "-")
                                + ("**" if label == r.strategy else "") for label in labels]
                    for r in found])
    step = sum(r.layers * sum(r.sent.values()) for r in found)
    on_ring = sum(r.layers * sum(r.formula[context_parallel.DEFAULT].values()) for r in found)
    return ("Per layer, each type on its own strategy: its blocks summed over the devices and rows, "
            "the slowest device's path through them, and the K/V bytes one device sends:\n\n" + own + "\n\nK/V bytes per layer, forward + backward, for every "
            "strategy the heads allow (the type's own in bold):\n\n" + every
            + f"\n\nA step sends {_mib(step)} MiB per device over all layers; every layer on the "
            f"ring: {_mib(on_ring)} MiB ({step / on_ring:.2f}x).\n")
