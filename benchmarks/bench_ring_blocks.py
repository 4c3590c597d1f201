"""The block size against the documents: bench_ring.py's rows at several blocks, with and without
document skipping, every result checked.

  .venv/bin/python benchmarks/bench_ring_blocks.py                # blocks 512, 256, 128; causal, docs9 and
                                                     # docs_s32 at S = 8192; every impl x layout
                                                     # (16 minutes on 2 shared cores)
  .venv/bin/python benchmarks/bench_ring_blocks.py --render-only  # rewrite the markdown from the JSON

A block is computed whole or not at all, so skipping can drop only the blocks that hold no
(query, key) pair of one document. With documents of mean length S/32 = 256 tokens at S = 8192,
a 512-token block holds about two of them: 32 of the causal mask's 136 blocks stay live, so no
ring at block 512 can run more than 136/32 = 4.25x faster with skipping on, whatever it does
per block (the target is 4x). At block 128 the live blocks are 200 of 2,080 (10.4x), and the
blocks skipping leaves are mostly the documents' own. Skipping off, the block size barely moves
the time on CPU (the same pairs, computed in larger or smaller pieces), so this measures what
the block costs and buys on each of the three kinds of row: causal without documents, few long
documents (docs9) and many short ones (docs_s32).

Each (case, block) is one bench_ring row (bench_ring.py's inputs, oracle check and round-robin
timing; a zigzag or striped variant halves the block until it divides its pieces). Writes
docs/bench_ring_blocks.json and its section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import bench_common as bc  # noqa: E402
import bench_ring as br  # noqa: E402
import bench_ring_report as report  # noqa: E402

CASES = ("causal", "docs9", "docs_s32")


def block_cell(row, name, key="median_s"):
    """'on' (ms) or, on a document case, 'on / off (x faster; blocks off/on)'."""
    v = row["variants"]
    on = v.get(name)
    if name + "/noskip" not in v:
        return report.cell(on, key)
    off = v[name + "/noskip"]
    speedup = report.summary(row, key).get("skip_speedup", {}).get(name)
    blocks = [f"{r['computed_blocks']:,}" if "computed_blocks" in r else "-" for r in (off, on)]
    return (f"{report.cell(on, key)} / {report.cell(off, key)} "
            f"({f'{speedup:.2f}x' if speedup else '-'}; {'/'.join(blocks)} blocks)")


def markdown(result, key="median_s"):
    st, m = result["settings"], result["machine"]
    blocks = st["blocks"]
    rows = {(r["case"], r["block"]): r for r in result["rows"]}
    names = [f"{impl}/{layout}" for impl in st["impls"] for layout in st["layouts"]]
    table = []
    for case in st["cases"]:
        for name in names:
            table.append([br.CASES[case].title, name]
                         + [block_cell(rows[(case, b)], name, key) if (case, b) in rows else "-"
                            for b in blocks])
    out = [
        "## The block size against the documents (`bench_ring_blocks.py`)\n",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPU cores ({m.get('cpu_model', '')}, shared), jax {m['jax']}, "
        f"{m['date_utc']} UTC"
        + (f", {result['wall_s'] / 60:.0f} min" if "wall_s" in result else "")
        + f". bench_ring.py's cases at S = {st['seq_len']:,}, sp = {st['sp']}, "
        f"{br.HEADS} heads x {br.HEAD_DIM}, float32, fwd+bwd, median of {st['repeats']} (the "
        "variants of a row timed round-robin); every variant checked against the dense oracle "
        f"(S <= {st['check_up_to']:,}). A cell: time with document skipping / without it (ms), "
        "the speedup, and the blocks computed off/on (a zigzag or striped block is halved until it "
        "divides the layout's pieces).\n",
        bc.table(["case", "ring"] + [f"block {b}" for b in blocks], table),
        "\n### The targets at each block, by wall time\n",
    ]
    for b in blocks:
        sub = dict(result, rows=[r for r in result["rows"] if r["block"] == b])
        out += [f"- block {b}: {line}" for line in report.targets(sub, key)
                if line.startswith(("docs_s32", "zigzag"))]
    out.append(f"- {report.check_line(result)}")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="512,256,128")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    ap.add_argument("--impls", default=",".join(br.IMPLS))
    ap.add_argument("--layouts", default=",".join(br.LAYOUTS))
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--check-up-to", type=int, default=8192,
                    help="largest S checked against the dense oracle")
    bc.add_output_arguments(ap, "bench_ring_blocks",
                            "rewrite the markdown section from --json without running")
    args = ap.parse_args()
    if args.render_only:
        cli.validated(f"--render-only from {args.json}")
        text = markdown(json.load(open(args.json)))
        bc.write_section("bench_ring_blocks", text, args.md)
        print(text)
        return 0
    blocks = [int(b) for b in args.blocks.split(",") if b]
    cases = br.selection(ap, args)
    args.peers = None  # run_row's: the peers are bench_ring.py's business
    mesh = br.sp_mesh(ap, args.sp)
    cli.validated(f"the flags are fine ({len(cases)} case(s) x {len(blocks)} block(s) on sp={args.sp})")
    result = {"command": bc.command_line(), "machine": bc.machine(),
              "settings": {"blocks": blocks, "cases": cases, "seq_len": args.seq_len, "sp": args.sp,
                           "repeats": args.repeats, "check_up_to": args.check_up_to,
                           "impls": list(args.impls), "layouts": list(args.layouts),
                           "fwd_tol": br.FWD_TOL, "grad_tol": br.GRAD_TOL},
              "rows": []}
    start = time.perf_counter()
    for case in cases:  # blocks inner: a case's oracle is computed once (bench_ring.row_oracle)
        for block in blocks:
            args.block = block
            result["rows"].append(br.run_row(args, mesh, br.CASES[case], args.seq_len))
            bc.write_json(args.json, result)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    bc.write_json(args.json, result)
    text = markdown(result)
    bc.write_section("bench_ring_blocks", text, args.md)
    print(text[text.index("### The targets at each block"):])
    return 0


if __name__ == "__main__":
    cli.run(main)
