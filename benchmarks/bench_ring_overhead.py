"""Where the ring's time goes on documents: the time of one block, and the time that does not
scale with blocks, so that the speedup of document skipping can be read against what the blocks
alone allow (the target: at least 4x on documents of mean length S/32 at S = 8192).

  .venv/bin/python benchmarks/bench_ring_overhead.py               # splash and xla, contiguous, S = 8192,
                                                      # sp = 4 and sp = 1 (about two minutes)
  .venv/bin/python benchmarks/bench_ring_overhead.py --one-core    # pinned to one core: CPU time = wall

Inputs: bench_ring.py's docs_s32 case (causal; documents of mean length S/32). Per impl and sp,
four variants of the same ring, each jit(forward + vjp over q, k, v):
  docs     skip_documents=True on the documents: computes the live blocks, B_docs of them
  one_doc  the same ring, one document per row: every causal block is live, B_all of them
  noskip   skip_documents=False on the documents: every causal block, B_all
  padding  the same ring as docs on rows of padding only: no live block anywhere
timed round-robin, median of N. With time = F + c x blocks (blocks from ops/tables.py):
  c = (one_doc - docs) / (B_all - B_docs): one block;
  F = docs - c x B_docs: the rest (block tables, K/V transfers, per-step passes over the shard,
      kernel calls), and F_noskip = noskip - c x B_all the same for the ring that skips nothing.
Skipping speeds the ring up by noskip / docs, B_all / B_docs if F were 0; a speedup r needs
F <= (c x B_all + F_noskip) / r - c x B_docs ("F for r" in the table). The padding rows measure
F directly for a ring that stops after its first step (nothing lives beyond it): the part of F
every call pays, to which each further step the documents reach adds its K/V transfer and step
overhead (S/32 documents reach the second step of a contiguous ring and every step of a
balanced one). The decomposed F also carries the medians' noise, amplified (a difference of two
medians over a difference of block counts), and what the model leaves out: a block is not
quite the same work on every input (with skipping off, the documents' blocks, mostly masked,
ran up to 4% faster than one document's here), so c and the decomposed F are estimates. sp = 1
is the same computation on one device: what the ring's own steps add to F is the difference.
Writes docs/bench_ring_overhead.json and its section of docs/benchmarks.md.
"""
import os
import sys

if "--one-core" in sys.argv:  # before jax starts its threads, which inherit the affinity
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

from longctx import cli  # noqa: E402

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
import bench_ring as br  # noqa: E402
from longctx.ops import masks  # noqa: E402

def with_segments(x, seg):
    """The inputs with segment ids `seg` (natural order) and the positions they give."""
    return dict(x, seg=seg, pos=masks.segment_positions(seg))


def one_document(x):
    """The inputs with every row one document (positions from 0 to S - 1)."""
    return with_segments(x, np.ones_like(x["seg"]))


def all_padding(x):
    """The inputs with every token padding (segment id 0): no block is live."""
    return with_segments(x, np.zeros_like(x["seg"]))


def decompose(rec, target):
    """c (block_s), F (fixed_s, fixed_noskip_s), the speedup and its bounds, from the three
    medians and block counts of `rec` (see the module docstring)."""
    b_docs, b_all = rec["docs_blocks"], rec["one_doc_blocks"]
    if not b_all == rec["noskip_blocks"] > b_docs:
        raise ValueError(f"blocks: docs {b_docs}, one document {b_all}, skipping off "
                         f"{rec['noskip_blocks']}: the documents must leave blocks to skip")
    c = (rec["one_doc_s"] - rec["docs_s"]) / (b_all - b_docs)
    fixed_noskip = rec["noskip_s"] - c * b_all
    return dict(block_s=c, fixed_s=rec["docs_s"] - c * b_docs, fixed_noskip_s=fixed_noskip,
                speedup=rec["noskip_s"] / rec["docs_s"], block_bound=b_all / b_docs,
                fixed_for_target_s=(c * b_all + fixed_noskip) / target - c * b_docs)


def measure(args, impl, layout, sp, seq_len):
    case = br.CASES["docs_s32"]
    mesh = bc.sp_mesh(sp)
    x = br.row_inputs(case, seq_len, sp)
    block = br.layout_block(min(args.block, seq_len // sp), seq_len // sp, layout)
    inputs = {"docs": (x, True), "one_doc": (one_document(x), True), "noskip": (x, False),
              "padding": (all_padding(x), True)}
    rec, runnable = {"impl": impl, "layout": layout, "sp": sp, "seq_len": seq_len,
                     "block": block}, {}
    for name, (xv, skip) in inputs.items():
        fn, fargs, _ = br.longctx_variant(mesh, case, xv, seq_len, sp, block, impl, layout, skip)
        compiled = fn.lower(*fargs).compile()
        jax.block_until_ready(compiled(*fargs))
        runnable[name] = (compiled, fargs)
        rec[f"{name}_blocks"] = br.computed_blocks(case, xv, seq_len, sp, block, layout, skip)
    times = {name: [] for name in runnable}
    for _ in range(args.repeats):  # round-robin, as bench_ring.py
        for name, (compiled, fargs) in runnable.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*fargs))
            times[name].append(time.perf_counter() - t0)
    for name in runnable:
        rec[f"{name}_s"] = float(np.median(times[name]))
    rec.update(decompose(rec, args.target))
    c = rec["block_s"]
    b_docs, b_all = rec["docs_blocks"], rec["one_doc_blocks"]
    print(f"{impl:6s} {layout:10s} sp={sp}: docs {rec['docs_s'] * 1e3:.0f} ms ({b_docs} blocks), "
          f"one_doc {rec['one_doc_s'] * 1e3:.0f} ({b_all}), noskip {rec['noskip_s'] * 1e3:.0f}; "
          f"block {c * 1e3:.2f} ms, F {rec['fixed_s'] * 1e3:.0f} ms (one step, padding "
          f"{rec['padding_s'] * 1e3:.0f}, noskip "
          f"{rec['fixed_noskip_s'] * 1e3:.0f}), speedup {rec['speedup']:.2f}x of "
          f"{rec['block_bound']:.2f}x; {args.target:g}x needs F <= "
          f"{rec['fixed_for_target_s'] * 1e3:.0f} ms", flush=True)
    return rec


def markdown(result):
    m, st = result["machine"], result["settings"]
    ms = lambda s: f"{s * 1e3:,.0f}"  # noqa: E731
    rows = [[r["impl"], r["layout"], r["sp"], f"{ms(r['docs_s'])} ({r['docs_blocks']})",
             f"{ms(r['one_doc_s'])} ({r['one_doc_blocks']})", ms(r["noskip_s"]),
             f"{r['block_s'] * 1e3:.2f}", ms(r["fixed_s"]), ms(r["padding_s"]),
             ms(r["fixed_noskip_s"]),
             f"{r['speedup']:.2f}x", f"{r['block_bound']:.2f}x", ms(r["fixed_for_target_s"])]
            for r in result["rows"]]
    headers = ["impl", "layout", "sp", "docs: ms (blocks)", "one document: ms (blocks)",
               "skipping off: ms", "c: ms per block", "F: ms", "F of one step (all padding): ms",
               "F skipping off: ms",
               "speedup (off / on)", "blocks off / on", f"F for {st['target']:g}x: ms"]
    return "\n".join([
        "## Where the ring's time goes on documents (`bench_ring_overhead.py`)\n",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPU cores ({m.get('cpu_model', '?')}, shared"
        + (", the run pinned to one" if st["one_core"] else "") + f"), jax {m['jax']}, "
        f"{m['date_utc']} UTC. bench_ring.py's docs_s32 inputs (causal, documents of mean length "
        f"S/32), S = {st['seq_len']:,}, {br.HEADS} heads x {br.HEAD_DIM}, float32, fwd+bwd, "
        f"median of {st['repeats']} round-robin runs (wall). With time = F + c x blocks: c from "
        "the ring on the documents and on one document per row (the same program), F the rest, "
        "and measured as the same program's time on rows of padding only (no live block: the "
        "ring stops after its first step); "
        f"skipping gives a {st['target']:g}x speedup only where F is at most the last column.\n",
        bc.table(headers, rows)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default=",".join(br.IMPLS))
    ap.add_argument("--layouts", default="contiguous")
    ap.add_argument("--sps", default="4,1", help="comma list of ring sizes")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target", type=float, default=4.0, help="the speedup to size F against")
    ap.add_argument("--one-core", action="store_true",
                    help="pin the process to one core (read before jax starts)")
    bc.add_output_arguments(ap, "bench_ring_overhead")
    args = ap.parse_args()
    br.impls_and_layouts(ap, args)
    sps = [int(s) for s in args.sps.split(",") if s]
    if not sps or any(sp < 1 or sp > jax.device_count() or args.seq_len % sp for sp in sps):
        ap.error(f"--sps {args.sps}: each must divide --seq-len and be at most "
                 f"{jax.device_count()} (the devices)")
    cli.validated("the flags are fine")
    result = {"command": bc.command_line(), "machine": bc.machine(),
              "settings": {"seq_len": args.seq_len, "block": args.block,
                           "repeats": args.repeats, "target": args.target,
                           "one_core": args.one_core},
              "rows": [measure(args, impl, layout, sp, args.seq_len)
                       for sp in sps for impl in args.impls for layout in args.layouts]}
    report = markdown(result)
    bc.write_json(args.json, result)
    bc.write_section("bench_ring_overhead", report, args.md)
    print(report)
    return 0


if __name__ == "__main__":
    cli.run(main)
