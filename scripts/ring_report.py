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
  .venv/bin/python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal \
      --doc-lengths 1000,3000,700,5000 --json          # lengths repeat to fill the row
  .venv/bin/python scripts/ring_report.py --seq-len 8192 --sp 4 --block 512 --causal --data data/mine \
      --batches 4                                       # real packed rows from the pipeline

  kept_blocks      blocks holding a (query, key) pair the mask and the documents allow
  computed_blocks  blocks the ring computes ([device][ring step], summed over the rows)
  doc_efficiency   kept / (sp * sum over run steps of max over devices of computed)
  critical_path    that sum: the blocks on the slowest device's path
  run_steps        ring steps with a live block on some device
  visited_steps    ring steps the ring goes through (K/V travel a hop each; the kernel of a
                   step with nothing live is skipped): with documents the ring stops after the
                   last step that runs when the mask's steps are one run
"""
import argparse
import json
import os
import sys

import numpy as np

from longctx import cli

cli.start()  # longctx.ops imports jax: CPU platform set before

from longctx.ops import masks  # noqa: E402
from longctx import ops  # noqa: E402
from longctx.ops import tables  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def _window(text):
    parts = [int(p) for p in text.split(",")]
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"--sliding-window {text!r}: expected W or LEFT,RIGHT")
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
    """Natural-order segment ids [rows, S] (0 = padding) from --doc-lengths or --data."""
    if a.doc_lengths:
        lengths = [int(n) for n in a.doc_lengths.split(",")]
        if min(lengths) < 1:
            raise ConfigError(f"--doc-lengths {a.doc_lengths}: lengths must be positive.")
        ids, t, doc = np.zeros(a.seq_len, np.int32), 0, 1
        while t < a.seq_len:
            n = min(lengths[(doc - 1) % len(lengths)], a.seq_len - t)
            ids[t:t + n], t, doc = doc, t + n, doc + 1
        return ids[None]
    from longctx.data import pipeline

    rows = pipeline.packed_rows(a.data, "train", seq_len=a.seq_len, packer=a.packer, seed=0)
    it = iter(rows)
    return np.stack([next(it)["segment_ids"] for _ in range(a.batches * a.batch_size)])


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
    docs = (f"documents {a.doc_lengths}" if a.doc_lengths else
            f"{len(ids)} rows of {a.data}")
    if a.json:
        print(json.dumps({"documents": docs, "rows": len(ids), "auto_layout": auto,
                          "auto_layout_by_the_mask": by_mask, "layouts": report}))
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
    return 0


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
    from longctx.parallel import layout as layout_lib

    if a.layout is None and not (a.doc_lengths or a.data):
        raise ConfigError("--layout is required (or give documents: --doc-lengths or --data).")
    if a.layout not in (None, "auto") + layout_lib.LAYOUTS:
        raise ConfigError(f"--layout={a.layout!r} is not one of {layout_lib.LAYOUTS + ('auto',)}.")
    try:
        layout_lib.permutation("contiguous" if a.layout in (None, "auto") else a.layout,
                               a.seq_len, a.sp)
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
    return f"a ring of {a.sp} devices over {a.seq_len:,} tokens in blocks of {a.block}"


def _describe(mask_kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in mask_kw.items() if v) or "full"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--sp", type=int, required=True, help="ring size (devices on the sp axis)")
    p.add_argument("--block", type=int, default=512, help="q and kv block size")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sliding-window", type=_window, default=None, help="W or LEFT,RIGHT")
    p.add_argument("--chunk-size", type=int, default=None, help="chunked causal")
    p.add_argument("--layout", default=None, help="contiguous | zigzag | striped | auto "
                   "(required without documents; with them every layout is reported)")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-lengths", default=None,
                      help="synthetic documents of N tokens, or a comma list N1,N2,... repeated")
    docs.add_argument("--data", default=None, help="a prepared data directory: real packed rows")
    p.add_argument("--batches", type=int, default=1, help="with --data: batches to read")
    p.add_argument("--batch-size", type=int, default=1, help="with --data: rows per batch")
    p.add_argument("--packer", default="best_fit", help="with --data: the packer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, help="write the device x step heatmap here")
    a = p.parse_args(argv)
    mask_kw = dict(causal=a.causal, sliding_window=a.sliding_window, chunk_size=a.chunk_size)
    if cli.validate_only():
        cli.validated(_check_arguments(a))
    if a.doc_lengths or a.data:
        try:
            return _documents_report(a, mask_kw)
        except ValueError as e:  # the tables' messages name the argument
            raise ConfigError(str(e)) from None
    if a.layout is None:
        raise ConfigError("--layout is required (or give documents: --doc-lengths or --data).")
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
