"""Schedule report of the attention ring: blocks computed per (device, ring step), steps, efficiency.

  python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --layout zigzag
  python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal \\
      --sliding-window 4096 --layout contiguous --json
  python scripts/ring_report.py --seq-len 131072 --sp 8 --block 512 --causal --layout auto \\
      --png docs/ring_causal.png

Only ring steps with work on some device are run (and listed); efficiency is
useful blocks / (sp * sum over run steps of max over devices of computed blocks).
--json prints one object: {"efficiency", "steps", "computed_blocks" ([device][run step])}.
--layout auto resolves to the layout ring_attention would use (named on stderr with --json).
"""
import argparse
import json
import sys

from longctx import cli

cli.start()  # longctx.ops imports jax: CPU platform set before

from longctx import masks, ops  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--sp", type=int, required=True, help="ring size (devices on the sp axis)")
    p.add_argument("--block", type=int, default=512, help="q and kv block size")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sliding-window", type=_window, default=None, help="W or LEFT,RIGHT")
    p.add_argument("--chunk-size", type=int, default=None, help="chunked causal")
    p.add_argument("--layout", required=True, help="contiguous | zigzag | striped | auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, help="write the device x step heatmap here")
    a = p.parse_args(argv)
    mask_kw = dict(causal=a.causal, sliding_window=a.sliding_window, chunk_size=a.chunk_size)
    try:
        layout = masks.resolve_layout(a.layout, a.seq_len, a.sp, **mask_kw)
        sched = ops.ring_schedule(a.seq_len, a.sp, a.block, layout, **mask_kw)
    except ValueError as e:  # masks' messages name the argument
        raise ConfigError(str(e)) from None
    blocks = sched.computed_blocks[:, list(sched.run_steps)]
    mask_desc = ", ".join(f"{k}={v}" for k, v in mask_kw.items() if v) or "full"
    title = (f"S={a.seq_len} sp={a.sp} block={a.block} {mask_desc} layout={layout}: "
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
