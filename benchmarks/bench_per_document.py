"""The per-document layout against the static ones on three sets of documents: the ring's critical
path against the ideal, the ring steps visited and the K/V passed per row (scripts/ring_report.py
--layout per_document, one process per set and size, as a user runs it), and a PNG of each
device's work in the first rows of each set. Host-side only: nothing is timed.

  .venv/bin/python benchmarks/bench_per_document.py              # both sizes (~30 minutes here)
  .venv/bin/python benchmarks/bench_per_document.py --sizes 131072
  .venv/bin/python benchmarks/bench_per_document.py --render-only

Sets: the embedded corpus (its prepared train split, one epoch), the seeded long-tailed mix
(longctx/data/length_mixes.py, most documents under 4K, a few 64K+) and the ProLong-style
mixture of configs/base.py:long_mix_cpu (its sources, the first --tokens of rows). Sizes:
131,072 tokens over sp = 8 and 1,048,576 over sp = 64, both with 16,384-token shards and blocks
of 512, causal. Writes docs/per_document.json, docs/per_document.md and
docs/per_document_<set>.png (the smaller size), after each set: a run replaces the sets and sizes
it reports and keeps the others.
"""
from longctx import cli

cli.start(cpu_devices=None)  # the reports are child processes; this one runs no jax

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from longctx.data import prepare  # noqa: E402

SIZES = {131_072: 8, 1_048_576: 64}
TARGETS = {131_072: 0.95, 1_048_576: 0.93}  # of the ideal, per_document
SETS = ("corpus", "long_tail", "prolong_mix")
# shard_balanced beside best_fit at the smaller size; at the larger docs/data.md has it already
PACKERS = {131_072: "best_fit,shard_balanced", 1_048_576: "best_fit"}
LAYOUT_ORDER = ("contiguous", "zigzag", "striped", "per_document")


def _set_flags(name: str, corpus_dir: str, seq_len: int) -> list[str]:
    """ring_report's flags for a set: at the larger size the mixes draw 16 rows' tokens (16 x S,
    as docs/data.md's), the corpus is one epoch at either size."""
    tokens = ["--tokens", str(16 * seq_len)] if seq_len > 131_072 else []
    return {"corpus": ["--data", corpus_dir],
            "long_tail": ["--mix", "long_tail", *tokens],
            "prolong_mix": ["--mixture", "configs/base.py:long_mix_cpu", *tokens]}[name]


def _shown(cmd: list[str]) -> str:
    """The command as docs show it: .venv's python, paths from the repository, ~ for home."""
    shown = [".venv/bin/python"] + [os.path.relpath(c, bc.REPO) if c.startswith(bc.REPO) else c
                                    for c in cmd[1:]]
    return shlex.join(shown).replace(os.path.expanduser("~"), "~")


def report(name: str, seq_len: int, corpus_dir: str, png: bool) -> dict:
    sp = SIZES[seq_len]
    cmd = [sys.executable, os.path.join(bc.REPO, "scripts", "ring_report.py"), "--seq-len", str(seq_len),
           "--sp", str(sp), "--block", "512", "--causal", "--layout", "per_document",
           "--packer", PACKERS[seq_len], *_set_flags(name, corpus_dir, seq_len), "--json"]
    if png:
        cmd += ["--png", os.path.join(bc.DOCS, f"per_document_{name}.png")]
    start = time.time()
    result = subprocess.run(cmd, cwd=bc.REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{_shown(cmd)} failed:\n{result.stderr[-3000:]}")
    return {"set": name, "seq_len": seq_len, "sp": sp, "command": _shown(cmd),
            "seconds": round(time.time() - start, 1), "report": json.loads(result.stdout)}


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def markdown(result: dict) -> str:
    lines = ["# The per-document layout on three sets of documents", "",
             f"Written by `benchmarks/bench_per_document.py` (the last run: `{result['command']}`, "
             f"{result['machine']['cpu_model']}, {result['machine']['date_utc']} UTC; host-side, "
             "nothing timed; each set's own command below). Each row of a set is "
             "laid out on its own (`attention.layout=per_document`, "
             "longctx/parallel/document_layout.py) and its ring schedule worked out as the ring runs "
             "it (ops/tables.document_schedule); the static layouts and `shard_balanced` on the same "
             "rows beside it. Causal, blocks of 512, 16,384-token shards; the ideal is the kept "
             "blocks / sp (blocks holding a pair the mask and the documents allow, natural order); "
             "K/V per row and layer for Llama-3-8B in bfloat16 (4 KiB per token): every device "
             "sends its whole shard at each hop. Definitions: longctx/data/packer_report.py.", ""]
    for seq_len in sorted({r["seq_len"] for r in result["runs"]}):
        runs = [r for r in result["runs"] if r["seq_len"] == seq_len]
        sp = runs[0]["sp"]
        lines += [f"## S = {seq_len:,}, sp = {sp}", ""]
        rows = []
        for r in runs:
            first = True
            # against striped on best_fit's rows (the same documents; shard_balanced runs contiguous)
            striped = r["report"]["packers"]["best_fit"]["layouts"]["striped"]
            for packer, p in r["report"]["packers"].items():
                for layout in [x for x in LAYOUT_ORDER if x in p["layouts"]]:
                    m = p["layouts"][layout]
                    auto = " (`auto`)" if layout == p["auto_layout"] else ""
                    vs = (f"{m['visited_mean'] / striped['visited_mean']:.2f} / "
                          f"{m['kv_bytes_per_row'] / striped['kv_bytes_per_row']:.2f}"
                          if striped["kv_bytes_per_row"] else "-")
                    rows.append([r["set"] if first else "", f"{packer}, {layout}{auto}",
                                 f"{p['padding']:.2%}",
                                 f"{m['critical_path']:,} / {m['ideal']:,.0f}", f"{m['of_ideal']:.3f}",
                                 f"{m['visited_mean']:.2f} / {m['visited_max']}",
                                 _mib(m["kv_bytes_per_row"]), vs])
                    first = False
        lines += [bc.table(["documents", "packer, layout", "padding", "critical path / ideal",
                            "of ideal", "steps visited per row, mean / max", "K/V MiB per row",
                            "vs striped: steps / K/V"], rows), ""]
        target = TARGETS[seq_len]
        lines += [f"Targets for the per-document layout (best_fit's rows): critical path at least "
                  f"{target} of the ideal" + ("; steps visited and K/V per row at most half of "
                                              "striped's" if seq_len == 131_072 else "") + ".", ""]
        for r in runs:
            p = r["report"]["packers"]["best_fit"]
            pd, st = p["layouts"]["per_document"], p["layouts"]["striped"]
            line = (f"- {r['set']}: {pd['of_ideal']:.3f} of the ideal "
                    f"({'met' if pd['of_ideal'] >= target else 'MISSED'})")
            if seq_len == 131_072:
                half = pd["visited_mean"] <= st["visited_mean"] / 2 and \
                    pd["kv_bytes_per_row"] <= st["kv_bytes_per_row"] / 2
                line += (f"; {pd['visited_mean']:.2f} steps against striped's {st['visited_mean']:.2f} "
                         f"({'met' if half else 'MISSED'}): no layout of these rows visits fewer "
                         f"than {p['rows_visited_bound']:.2f} per row (a row visits at least as many "
                         f"steps as its longest piece spans shards), no packer's fewer than "
                         f"{p['visited_bound']:.2f}")
            lines.append(line + f". `{r['command']}` ({r['seconds']:,.0f} s)")
        lines.append("")
    pngs = [f"[{s}](per_document_{s}.png)" for s in SETS
            if any(r["set"] == s and r["seq_len"] == 131_072 for r in result["runs"])]
    if pngs:
        lines += ["Each device's work in the first three rows of each set at 131,072 tokens, stacked "
                  "by ring step, per packer and layout: " + ", ".join(pngs) + ".", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES),
                   help=f"comma list of sequence lengths among {', '.join(str(s) for s in SIZES)}")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma list of {', '.join(SETS)}")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "longctx"),
                   help="where the embedded corpus is prepared")
    bc.add_page_arguments(p, "per_document")
    args = p.parse_args()
    if bc.render_only(args, markdown):
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    sets = args.sets.split(",")
    bad = [s for s in sizes if s not in SIZES] + [s for s in sets if s not in SETS]
    if bad:
        raise SystemExit(f"--sizes/--sets: {', '.join(map(str, bad))} not among "
                         f"{', '.join(map(str, SIZES))} / {', '.join(SETS)}.")
    cli.validated(f"{len(sets)} set(s) at {len(sizes)} size(s)")  # under --validate_only
    corpus_dir = prepare.prepare_stdlib(args.cache_dir, progress=True)
    kept = []
    if os.path.exists(args.json):
        with open(args.json) as f:
            kept = json.load(f)["runs"]
    for seq_len in sizes:
        for name in sets:
            run = report(name, seq_len, corpus_dir, png=seq_len == 131_072)
            print(f"{name} at {seq_len:,}: {run['seconds']:,.0f} s", flush=True)
            kept = [r for r in kept if (r["set"], r["seq_len"]) != (name, seq_len)] + [run]
            kept.sort(key=lambda r: (r["seq_len"], SETS.index(r["set"])))
            result = {"command": bc.command_line(), "machine": {
                "cpu_model": bc.cpu_model(), "cpu_count": os.cpu_count(),
                "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}, "runs": kept}
            bc.write_json(args.json, result)
            bc.write_markdown(args.md, markdown(result))
    print(markdown(result))

if __name__ == "__main__":
    cli.run(main)
