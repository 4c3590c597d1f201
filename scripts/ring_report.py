"""Schedule report of the attention ring: blocks computed per (device, ring step), steps, efficiency.

  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --layout zigzag
  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal \\
      --sliding-window 4096 --layout contiguous --json
  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --layout auto \\
      --png docs/ring_causal.png

Only ring steps with work on some device are run (and listed); efficiency is
useful blocks / (sp * sum over run steps of max over devices of computed blocks).
--json prints one object: {"efficiency", "steps", "computed_blocks" ([device][run step])}.
--layout auto resolves to the layout ring_attention would use (named on stderr with --json).

With documents the report covers every layout (the ring skips blocks whose queries and keys
share no document, so the layouts compare differently than for the mask alone) and names the
layout "auto" picks on those rows, as a training run does on its first rows (data.layout_sample;
`auto_layout`, and `auto_layout_by_the_mask` for the mask alone):

  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --doc-lengths 4096
  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal \\
      --doc-lengths 1000,3000,700,5000 --json          # lengths repeat to fill the row
  .venv/bin/python scripts/ring_report.py --seq-len 8192 --sp 4 --block 256 --causal \\
      --doc-lengths 256 --strategies ring,all_gather,ulysses,usp:2   # each context-parallel strategy

  kept_blocks      blocks holding a (query, key) pair the mask and the documents allow
  computed_blocks  blocks the ring computes ([device][ring step], summed over the rows)
  doc_efficiency   kept / (sp * sum over run steps of max over devices of computed)
  critical_path    that sum: the blocks on the slowest device's path
  run_steps        ring steps with a live block on some device
  visited_steps    ring steps the ring goes through (K/V travel a hop each; the kernel of a
                   step with nothing live is skipped): with documents the ring stops after the
                   last step that runs when the mask's steps are one run

`--strategies` adds, on the layout auto picks (or `--layout`), what each context-parallel
strategy computes on those rows (longctx.ops.strategy_schedule; `usp:U` names usp's Ulysses
degree): computed and kept blocks, the critical path (blocks, of all heads, on the slowest path,
with the strategy's waits), the ring steps K/V travel and the efficiency.

With `--config FILE:PRESET` the report is per layer type of that model (attention.pattern and
attention.layer_types; one type without a pattern), each on its own mask, block and strategy:
the layers of the type, the ring steps its mask runs (and halo's exchanges), the blocks its strategy
computes and the critical path, and the K/V bytes one device sends per layer, forward and backward,
for every strategy by the closed form (longctx/plan/collectives.py), with the type's own strategy
marked. `--topology` also reads its own strategy's bytes from the lowered TPU program (abstract
devices, nothing runs; needs libtpu). --seq-len and --sp default to the config's, --doc-lengths to
one document per row; `--md` writes the tables with this command (docs/hybrid_traffic.md):

  .venv/bin/python scripts/ring_report.py --config configs/base.py:gemma3_12b_128k --sp 16 \\
      --doc-lengths 16384 --topology v5p:2x2x4 --md docs/hybrid_traffic.md

With `--data DIR` (a prepared directory's train split) or `--mix long_tail|uniform` (seeded
synthetic document lengths, longctx/data/length_mixes.py) the report compares packers instead:
each packs one epoch of the same documents (`--packer`, a comma list; every packer by default),
and the ring's schedule of each row is worked out under every layout the packer may run with
(shard_balanced: contiguous only; `--layout per_document` adds each row laid out from its own
documents, parallel/document_layout.py). Per packer and layout it prints the padding, the critical path
against the ideal (kept blocks / sp), the ring steps visited per row and the K/V passed per row
(longctx/data/packer_report.py defines each), and marks the layout "auto" picks on those rows:

  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --mix uniform
  .venv/bin/python scripts/ring_report.py --seq-len 8192 --sp 4 --block 512 --causal --data data/mine \\
      --packer best_fit,shard_balanced --png docs/mine_packers.png   # per-device work of 3 rows
"""
import argparse
import dataclasses
import json
import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # longctx.ops imports jax: CPU platform set before

import numpy as np  # noqa: E402

from longctx.ops import masks  # noqa: E402
from longctx import ops  # noqa: E402
from longctx.ops import context_parallel, strategy_schedule, tables  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.data import length_mixes, packer_report  # noqa: E402
from longctx.data.packing import PACKERS, packer_layout  # noqa: E402
from longctx.parallel import layout as layout_lib  # noqa: E402


def _window(text):
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not W or LEFT,RIGHT (whole numbers, at least 0)")
    return parts[0] if len(parts) == 1 else tuple(parts)


def _png(path, sched, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    blocks = sched.computed_blocks[:, list(sched.run_steps)]
    sp, steps = blocks.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * steps, 1.0 + 0.45 * sp))
    im = ax.imshow(blocks, cmap="viridis", aspect="auto", vmin=0)
    ax.set_xticks(range(steps), [str(s) for s in sched.run_steps])
    ax.set_yticks(range(sp), [str(d) for d in range(sp)])
    ax.set_xlabel("ring step")
    ax.set_ylabel("device")
    ax.set_title(title, fontsize=9)
    for d in range(sp):
        for s in range(steps):
            light = blocks[d, s] > 0.6 * max(1, blocks.max())  # viridis is yellow at the top
            ax.text(s, d, str(blocks[d, s]), ha="center", va="center",
                    color="k" if light else "w", fontsize=7)
    fig.colorbar(im, ax=ax, label="blocks computed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _doc_rows(a) -> np.ndarray:
    """Natural-order segment ids [1, S] (0 = padding) from --doc-lengths."""
    if a.doc_lengths:
        try:
            return length_mixes.segment_ids_of(a.doc_lengths.split(","), a.seq_len)
        except ValueError:
            raise ConfigError(f"--doc-lengths {a.doc_lengths}: lengths must be positive.") from None


def _documents_report(a, mask_kw) -> int:
    ids = _doc_rows(a)
    spec = masks.make_mask_spec(**mask_kw)
    # what a training run on these rows would pick (longctx.train.state.resolve_layout), and by the mask alone
    auto = ops.resolve_layout("auto", a.seq_len, a.sp, block_size=a.block, segment_ids=ids,
                                **mask_kw)
    by_mask = ops.resolve_layout("auto", a.seq_len, a.sp, block_size=a.block, **mask_kw)
    report = {}
    for layout in ("contiguous", "zigzag", "striped"):
        _say_when_large(a, layout)
        try:
            sched = tables.document_schedule(spec, layout, a.seq_len, a.sp, a.block, ids)
        except ValueError as e:  # e.g. zigzag needs seq_len divisible by 2*sp
            report[layout] = {"error": str(e)}
            continue
        report[layout] = {"kept_blocks": sched.kept_blocks,
                          "computed_blocks": sched.computed_blocks[:, list(sched.run_steps)].tolist(),
                          "run_steps": list(sched.run_steps),
                          "visited_steps": list(sched.visited_steps),
                          "doc_efficiency": sched.efficiency,
                          "critical_path": sched.critical_path}
        if a.png:
            root, ext = os.path.splitext(a.png)
            _png(f"{root}_{layout}{ext or '.png'}", sched,
                 f"S={a.seq_len} sp={a.sp} {layout}, documents: efficiency {sched.efficiency:.3f}")
    docs = f"documents {a.doc_lengths}"
    cp_layout = auto if a.layout in (None, "auto") else a.layout
    strategies = _strategies_report(a, spec, ids, cp_layout) if a.strategies else None
    if a.json:
        print(json.dumps({"documents": docs, "rows": len(ids), "auto_layout": auto,
                          "auto_layout_by_the_mask": by_mask, "layouts": report,
                          **({"strategies": strategies} if strategies else {})}))
        return 0
    print(f"S={a.seq_len} sp={a.sp} block={a.block} {_describe(mask_kw)}, {docs} "
          f"(layout auto on these documents -> {auto}; by the mask alone -> {by_mask})")
    print(f"{'layout':>11} {'kept':>8} {'computed':>9} {'critical path':>14} "
          f"{'steps run/visited':>18} {'doc efficiency':>15}")
    for layout, r in report.items():
        if "error" in r:
            print(f"{layout:>11}  {r['error']}")
            continue
        computed = int(np.sum(r["computed_blocks"]))
        steps = f"{len(r['run_steps'])}/{len(r['visited_steps'])}"
        print(f"{layout:>11} {r['kept_blocks']:>8} {computed:>9} {r['critical_path']:>14} "
              f"{steps:>18} {r['doc_efficiency']:>15.4f}")
    if strategies:
        print(f"context-parallel strategies on the {cp_layout} layout:")
        print(f"{'strategy':>11} {'kept':>8} {'computed':>9} {'critical path':>14} {'steps':>6} "
              f"{'efficiency':>11}")
        for name, r in strategies.items():
            print(f"{name:>11} {r['kept_blocks']:>8} {r['computed_blocks']:>9.0f} "
                  f"{r['critical_path']:>14.1f} {r['steps']:>6} {r['efficiency']:>11.4f}")
    return 0


def _strategy_list(text: str) -> list[tuple[str, int | None]]:
    """--strategies "ring,usp:2" -> [("ring", None), ("usp", 2)]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, _, degree = item.partition(":")
        known = context_parallel.REGISTRY
        if name not in known or known[name].takes_degree != bool(degree):
            raise ConfigError(f"--strategies {text}: {item!r} is not one of {', '.join(known)} "
                              "(usp as usp:U, U its Ulysses degree).")
        out.append((name, int(degree) if degree else None))
    return out


def _strategies_report(a, spec, ids, layout) -> dict:
    report = {}
    for name, degree in _strategy_list(a.strategies):
        if degree is not None and (degree < 1 or a.sp % degree):
            raise ConfigError(f"--strategies: usp:{degree} needs a degree dividing --sp {a.sp}.")
        r = strategy_schedule.strategy_schedule(context_parallel.named(name, degree), spec, layout,
                                                a.seq_len, a.sp, a.block, ids)
        report[name if degree is None else f"{name}:{degree}"] = {
            "kept_blocks": r.kept_blocks, "computed_blocks": r.computed_blocks,
            "work_per_device": r.work.tolist(), "critical_path": r.critical_path,
            "steps": r.steps, "efficiency": r.efficiency}
    return report


def _packers(a) -> list[str]:
    packers = [p.strip() for p in a.packer.split(",") if p.strip()]
    for p in packers:
        if p not in PACKERS:
            raise ConfigError(f"--packer {p!r} is not one of {', '.join(PACKERS)}.")
    return packers


def _packers_report(a, mask_kw) -> int:
    """Every packer on one epoch of the same documents, under every layout it may run with."""
    spec = masks.make_mask_spec(**mask_kw)
    keep = None if a.batches is None else a.batches * a.batch_size
    shape = dict(seq_len=a.seq_len, sp=a.sp, block=a.block, keep=keep, seed=a.seed)
    if a.mix:
        lengths = length_mixes.document_lengths(a.mix, a.tokens, a.seed)
        documents = length_mixes.documents(lengths)
        source = f"{len(lengths):,} documents of the {a.mix} mix (seed {a.seed}, {int(lengths.sum()):,} tokens)"
    elif a.mixture:
        mixed = cli.load_config_file(a.mixture)
        count = keep or max(1, a.tokens // a.seq_len)
        source = f"the first {count} rows of {a.mixture}'s data mixture (shuffle seed {a.seed})"
    else:
        source = f"the train split of {a.data} (shuffle seed {a.seed})"
    report = {}
    for packer in _packers(a):
        if a.mix:
            rows = packer_report.document_rows(documents, packer, **shape)
        elif a.mixture:
            rows = packer_report.mixture_rows(mixed, packer, seq_len=a.seq_len, sp=a.sp,
                                              block=a.block, rows=count, seed=a.seed)
        else:
            rows = packer_report.data_rows(a.data, packer, **shape)
        ids = rows.segment_ids
        row_layouts = (a.layout,) if a.layout in layout_lib.ROW_LAYOUTS else ()
        schedules = {layout: packer_report.row_schedules(spec, layout, a.seq_len, a.sp, a.block, ids)
                     for layout in packer_report.layouts_for(packer, row_layouts)}
        kept = packer_report.kept_blocks(spec, a.seq_len, a.sp, a.block, ids, schedules.get("contiguous"))
        # What a training run would pick on its first rows (train.state.resolve_layout).
        fixed = packer_layout(packer)
        auto = fixed or ops.resolve_layout("auto", a.seq_len, a.sp, block_size=a.block,
                                           segment_ids=ids[:8], **mask_kw)
        lengths = packer_report.pieces(ids)
        bounds = {"visited_bound": packer_report.visited_bound(lengths, len(ids), a.seq_len, a.sp),
                  "rows_visited_bound": (packer_report.rows_visited_bound(ids, a.seq_len, a.sp)
                                         if spec.window is None and spec.chunk is None else None),
                  "boundary_padding": packer_report.boundary_padding(lengths, a.seq_len, a.sp),
                  "contiguous_bound": (packer_report.contiguous_bound(lengths, a.seq_len, a.sp, a.block)
                                       if spec.causal and spec.window is None and spec.chunk is None
                                       else None)}  # its proof is for the causal mask
        report[packer] = {"padding": rows.padding, "epoch_rows": rows.epoch_rows, "rows": len(ids),
                          "kept_blocks": kept, "auto_layout": auto, **bounds, "layouts": {
                              layout: packer_report.summarize(sch, kept, a.sp, a.seq_len, a.batch_size,
                                                              a.kv_bytes_per_token)
                              for layout, sch in schedules.items()}}
    if a.png:
        _work_png(a.png, report, f"S={a.seq_len} sp={a.sp} block={a.block} {_describe(mask_kw)}, {source}")
    if a.json:
        for r in report.values():
            for summary in r["layouts"].values():
                del summary["device_work"]
        print(json.dumps({"documents": source, "packers": report}))
        return 0
    print(f"S={a.seq_len} sp={a.sp} block={a.block} {_describe(mask_kw)}, {source}; one pass of "
          f"{a.batch_size} row(s) per ring; K/V {a.kv_bytes_per_token} bytes per token and layer; "
          f"* = the layout auto picks")
    print(f"{'packer':>18} {'layout':>12} {'rows':>5} {'padding':>8} {'critical path':>14} "
          f"{'ideal':>10} {'of ideal':>9} {'visited mean/max':>17} {'K/V MiB/row':>12}")
    for packer, r in report.items():
        for layout, m in r["layouts"].items():
            mark = "*" if layout == r["auto_layout"] else " "
            print(f"{packer:>18} {layout + mark:>12} {r['rows']:>5} {r['padding']:>8.2%} "
                  f"{m['critical_path']:>14,} {m['ideal']:>10,.0f} {m['of_ideal']:>9.3f} "
                  f"{m['visited_mean']:>11.2f} / {m['visited_max']:<3} "
                  f"{m['kv_bytes_per_row'] / 2**20:>12,.0f}")
    print("what no packer passes on these pieces (longctx/data/packer_report.py derives each):")
    for packer, r in report.items():
        contiguous = ("" if r["contiguous_bound"] is None else
                      f"; of ideal <= {r['contiguous_bound']:.3f} in the contiguous layout")
        rows_bound = ("" if r["rows_visited_bound"] is None else
                      f" ({r['rows_visited_bound']:.2f} for these rows)")
        print(f"{packer:>18}  visited >= {r['visited_bound']:.2f} per row in any layout{rows_bound}{contiguous}; "
              f"padding >= {r['boundary_padding']:.2%} if every piece longer than a shard starts on "
              "a shard boundary")
    if a.png:
        print(f"per-device work: {a.png}")
    return 0


def _work_png(path, report, title, rows=3):
    """Blocks per device of the first `rows` rows, stacked by ring step: one line of panels per
    (packer, layout)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = [(p, layout, m) for p, r in report.items() for layout, m in r["layouts"].items()]
    rows = min(rows, min(len(m["device_work"]) for _, _, m in lines))
    fig, axes = plt.subplots(len(lines), rows, figsize=(3.2 * rows, 1.9 * len(lines)),
                             squeeze=False, sharey="row")
    colors = plt.get_cmap("viridis")
    for i, (packer, layout, m) in enumerate(lines):
        for r in range(rows):
            work = np.asarray(m["device_work"][r])  # [device, ring step]
            sp = work.shape[0]
            bottom = np.zeros(sp)
            ax = axes[i, r]
            for s in range(sp):
                if work[:, s].any():
                    ax.bar(range(sp), work[:, s], bottom=bottom, color=colors(s / max(1, sp - 1)),
                           label=f"step {s}")
                    bottom += work[:, s]
            busiest = int(sum(work[:, s].max() for s in range(sp)))
            ax.set_title(f"{packer}, {layout}, row {r}: path {busiest:,} / ideal {work.sum() / sp:,.0f}",
                         fontsize=7)
            ax.tick_params(labelsize=6)
            if r == 0:
                ax.set_ylabel("blocks", fontsize=7)
            if i == len(lines) - 1:
                ax.set_xlabel("device", fontsize=7)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=6, ncol=1)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Block rows per sequence from which the schedule takes long enough to say so first (seconds at
# 256, 131,072 tokens at block 512; minutes at 2,048): the tables grow with its square.
LARGE_BLOCK_ROWS = 256


def _say_when_large(a, layout) -> None:
    """One line on stderr before a schedule that takes a while (stdout keeps the report, --json's
    one object included)."""
    rows = a.seq_len // max(1, a.block)
    if rows >= LARGE_BLOCK_ROWS:
        print(f"ring_report: working out the {layout} schedule of {rows:,} x {rows:,} blocks over "
              f"{a.sp} devices ...", file=sys.stderr, flush=True)


def _check_arguments(a) -> str:
    """--validate_only: what the report would refuse, checked without working out a schedule."""
    if a.layout is None and not (a.doc_lengths or a.data or a.mix or a.mixture):
        raise ConfigError("--layout is required (or give documents: --doc-lengths, --data or --mix).")
    known = layout_lib.LAYOUTS + layout_lib.ROW_LAYOUTS + ("auto",)
    if a.layout not in (None,) + known:
        raise ConfigError(f"--layout={a.layout!r} is not one of {known}.")
    if layout_lib.per_row(a.layout or "") and not (a.data or a.mix or a.mixture):
        raise ConfigError(f"--layout={a.layout} lays out each row from its documents: give them "
                          "with --data or --mix.")
    try:
        layout_lib.permutation("contiguous" if a.layout in (None, "auto") + layout_lib.ROW_LAYOUTS
                               else a.layout, a.seq_len, a.sp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if a.block < 1 or (a.seq_len // a.sp) % a.block:
        raise ConfigError(f"block_size={a.block} does not divide the shard length "
                          f"{a.seq_len // a.sp} (seq_len={a.seq_len} / num_shards={a.sp})")
    if a.doc_lengths:
        _doc_rows(a)  # positive lengths
    if a.data:
        from longctx.data import pipeline

        pipeline.load_metadata(a.data)
    if a.mixture:
        cli.load_config_file(a.mixture)
    if a.data or a.mix or a.mixture:
        _packers(a)
        if a.mix and a.mix not in length_mixes.MIXES:
            raise ConfigError(f"--mix={a.mix!r} is not one of {', '.join(length_mixes.MIXES)}.")
    return f"a ring of {a.sp} devices over {a.seq_len:,} tokens in blocks of {a.block}"


def _describe(mask_kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in mask_kw.items() if v) or "full"


def build_parser() -> argparse.ArgumentParser:
    """The flags, each integer one with its range (a value outside it is one line naming the flag)."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=cli.int_at_least(1), default=None,
                   help="tokens per row (required, except with --config: its data.seq_len)")
    p.add_argument("--sp", type=cli.int_at_least(1), default=None,
                   help="ring size, devices on the sp axis (required, except with --config: its mesh.sp)")
    p.add_argument("--config", default=None, help="FILE:PRESET: the report per layer type of that model")
    p.add_argument("--topology", default=None,
                   help="with --config: also read each type's bytes from the lowered program for this "
                   "TPU topology (abstract devices; at least --sp of them)")
    p.add_argument("--md", default=None, help="with --config: write the tables and the command here")
    p.add_argument("--block", type=cli.int_at_least(1), default=512, help="q and kv block size")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sliding-window", type=_window, default=None,
                   help="W or LEFT,RIGHT (tokens, 0 or more)")
    p.add_argument("--chunk-size", type=cli.int_at_least(1), default=None, help="chunked causal")
    p.add_argument("--layout", default=None, help="contiguous | zigzag | striped | auto "
                   "(required without documents; with them every layout is reported); with --data "
                   "--mix or --mixture, per_document reports each row laid out from its documents too")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-lengths", default=None,
                      help="synthetic documents of N tokens, or a comma list N1,N2,... repeated")
    docs.add_argument("--data", default=None,
                      help="a prepared data directory: compare packers on its train split")
    docs.add_argument("--mix", default=None, help="long_tail | uniform: compare packers on "
                      "seeded synthetic document lengths")
    docs.add_argument("--mixture", default=None, help="FILE:PRESET: compare packers on the first "
                      "--tokens of that config's data mixture (data.sources, e.g. "
                      "configs/base.py:long_mix_cpu)")
    p.add_argument("--tokens", type=cli.int_at_least(1), default=16 << 20,
                   help="with --mix: tokens to draw; with --mixture: tokens of rows to read")
    p.add_argument("--seed", type=cli.int_at_least(0), default=0,
                   help="with --data / --mix: shuffle / draw seed (0 or more)")
    p.add_argument("--packer", default=",".join(PACKERS),
                   help="with --data / --mix: the packers to compare, a comma list")
    p.add_argument("--batches", type=cli.int_at_least(1), default=None,
                   help="with --data / --mix: measure the first batches only (default: the epoch)")
    p.add_argument("--batch-size", type=cli.int_at_least(1), default=1,
                   help="with --data / --mix: rows per ring pass (per device's local batch)")
    p.add_argument("--kv-bytes-per-token", type=cli.int_at_least(1), default=packer_report.KV_BYTES_PER_TOKEN,
                   help="with --data / --mix: K and V bytes per token and layer (default "
                   "Llama-3-8B's in bfloat16)")
    p.add_argument("--strategies", default=None,
                   help="with --doc-lengths: ring,all_gather,ulysses,usp:U (context-parallel strategies)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, help="write the device x step heatmap here")
    return p


def _config_of(a):
    """--config's model on --sp devices of the sp axis (--batch-size rows each) at --seq-len."""
    from longctx import config as config_lib  # lazily, as every --config import: the model and
    # the planner load in seconds that the other reports need not wait
    config = cli.load_config_file(a.config)
    config.unlock()
    if a.seq_len:
        config.data.seq_len = a.seq_len
    a.seq_len = config.data.seq_len
    a.sp = a.sp or config.mesh.sp
    if a.sp < 1:
        raise ConfigError(f"--sp: {a.config} leaves mesh.sp to the devices ({a.sp}); give --sp.")
    config.mesh.update(dp=1, fsdp=1, sp=a.sp)
    config.data.global_batch_size = a.batch_size
    # The sequence first: it is what --sp splits here (validate would name d_model, split over sp
    # with the parameters, before it).
    zigzag = config.attention.layout == "zigzag"  # (2 * sp pieces)
    if a.seq_len % (a.sp * (2 if zigzag else 1)):
        split = a.seq_len // 2 if zigzag else a.seq_len
        fits = [n for n in range(2, min(split, 4096) + 1) if split % n == 0][:4]
        raise ConfigError(f"--sp {a.sp} does not divide {'half of ' if zigzag else ''}the {a.seq_len:,}-token "
                          f"sequence{' (the zigzag layout)' if zigzag else ''}, which the sp devices hold in "
                          f"equal shards: pass an --sp that does ({', '.join(map(str, fits))}, ...) or another "
                          "--seq-len.")
    config_lib.validate(config, num_devices=a.sp)
    return config


def _mesh_of(a):
    """An sp mesh of --sp abstract devices of --topology, or None without it."""
    if not a.topology:
        return None
    from longctx.plan import aot  # lazily (--config)

    devices = aot.topology_devices(a.topology)
    if len(devices) < a.sp:
        raise ConfigError(f"--topology={a.topology} has {len(devices)} devices, fewer than --sp {a.sp}.")
    import jax  # lazily: the other reports need no jax mesh

    return jax.sharding.Mesh(np.array(devices[:a.sp]), ("sp",),
                             axis_types=(jax.sharding.AxisType.Auto,))


def _layer_types_report(a) -> int:
    from longctx import reports  # lazily (--config)
    from longctx.plan import layer_type_report
    from longctx.train import state as train_state

    config = _config_of(a)
    ids = _doc_rows(a) if a.doc_lengths else np.ones((1, a.seq_len), np.int32)
    layout = a.layout if a.layout not in (None, "auto") else train_state.resolve_layout(config, a.sp, ids)
    if cli.validate_only():
        _mesh_of(a)
        cli.validated(f"the per-layer-type report of {a.config} over sp={a.sp} at {a.seq_len:,} tokens")
    found = layer_type_report.type_reports(config, sp=a.sp, layout=layout, segment_ids=ids,
                                           rows=a.batch_size, mesh=_mesh_of(a))
    if a.json:
        print(json.dumps({"layout": layout, "types": [dataclasses.asdict(r) for r in found]}))
        return 0
    docs = f"documents of {a.doc_lengths} tokens" if a.doc_lengths else "one document per row"
    text = (f"{a.config} at {a.seq_len:,} tokens over sp = {a.sp} ({layout} layout, {docs}, "
            f"{a.batch_size} row(s) per device)\n\n" + layer_type_report.markdown(found, a.topology))
    print(text)
    if a.md:
        reports.write_markdown(a.md, "# K/V traffic per layer type\n\nWritten by `"
                               + reports.command_line() + "`.\n\n" + text)
        print(f"written: {a.md}")
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.config:
        return _layer_types_report(a)
    if a.seq_len is None or a.sp is None:
        raise ConfigError("--seq-len and --sp are required (or --config FILE:PRESET, which has them).")
    mask_kw = dict(causal=a.causal, sliding_window=a.sliding_window, chunk_size=a.chunk_size)
    if cli.validate_only():
        cli.validated(_check_arguments(a))
    if a.data or a.mix or a.mixture:
        try:
            return _packers_report(a, mask_kw)
        except ValueError as e:  # the tables' messages name the argument
            raise ConfigError(str(e)) from None
    if a.doc_lengths:
        try:
            return _documents_report(a, mask_kw)
        except ValueError as e:  # the tables' messages name the argument
            raise ConfigError(str(e)) from None
    if a.layout is None:
        raise ConfigError("--layout is required (or give documents: --doc-lengths, --data or --mix).")
    try:
        _say_when_large(a, a.layout)
        layout = ops.resolve_layout(a.layout, a.seq_len, a.sp, **mask_kw)
        sched = ops.ring_schedule(a.seq_len, a.sp, a.block, layout, **mask_kw)
    except ValueError as e:  # masks' messages name the argument
        raise ConfigError(str(e)) from None
    blocks = sched.computed_blocks[:, list(sched.run_steps)]
    title = (f"S={a.seq_len} sp={a.sp} block={a.block} {_describe(mask_kw)} layout={layout}: "
             f"{sched.steps} steps, efficiency {sched.efficiency:.3f}")
    if a.png:
        _png(a.png, sched, title)
    if a.json:
        if a.layout == "auto":
            print(f"layout auto -> {layout}", file=sys.stderr)
        print(json.dumps({"efficiency": sched.efficiency, "steps": sched.steps,
                          "computed_blocks": blocks.tolist()}))
        return 0
    print(title)
    width = max(5, len(str(blocks.max())) + 1)
    print("device \\ step " + "".join(f"{s:>{width}}" for s in sched.run_steps))
    for d in range(a.sp):
        print(f"{d:>13} " + "".join(f"{x:>{width}}" for x in blocks[d]))
    print(f"ring steps run: {sched.steps} of {a.sp} (steps {list(sched.run_steps)}); "
          f"K/V travel {max(sched.run_steps)} hops")
    print(f"blocks computed: {int(blocks.sum())}; critical path: {sched.critical_path} blocks")
    print(f"schedule efficiency: {sched.efficiency:.4f}")
    if a.png:
        print(f"heatmap: {a.png}")
    return 0


if __name__ == "__main__":
    cli.run(main)
