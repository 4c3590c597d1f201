"""The kernel path on one TPU chip (sp=1) on packed documents: the rows in their natural order
(layout contiguous, one set of positions for every row) against the same rows in the per-document
layout (each row permuted, its tokens' positions read per row: ops/splash_kernels.py's per-row
position specs). Same inputs, same run, interleaved.

  .venv/bin/python benchmarks/bench_tpu_per_document.py            # on a TPU VM

bf16, batch --batch, causal with documents (--documents random cuts per row, seeded), ring_attention
under shard_map on a one-device mesh with impl=splash; time of jit(vjp) forward + backward and of
the forward alone, median of --reps after a compile, the two layouts alternating --rounds times;
the outputs and gradients, put back in natural order, checked to match. Writes
docs/tpu_per_document.json and .md. Nothing here runs on CPU: the kernels' speed is the chip's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from longctx import cli  # noqa: E402

cli.start(cpu_devices=None)  # the chip's devices, not CPU ones

LAYOUTS = ("contiguous", "per_document")


def _arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=cli.int_at_least(1), default=32768)
    p.add_argument("--batch", type=cli.int_at_least(1), default=2)
    p.add_argument("--heads", default="32/8", help="query heads / kv heads")
    p.add_argument("--head-dim", type=cli.int_at_least(1), default=128)
    p.add_argument("--block", type=cli.int_at_least(1), default=1024)
    p.add_argument("--documents", type=cli.int_at_least(1), default=32, help="documents per row")
    p.add_argument("--reps", type=cli.int_at_least(1), default=5)
    p.add_argument("--rounds", type=cli.int_at_least(1), default=3)
    bc.add_page_arguments(p, "tpu_per_document")
    return p.parse_args(argv)


def _segments(seq_len, batch, documents):
    """Natural-order segment ids [batch, S]: `documents` documents per row at random cuts."""
    rng = np.random.default_rng(seq_len)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=documents - 1, replace=False))
        starts = np.zeros(seq_len, np.int32)
        starts[cuts] = 1
        rows.append(np.cumsum(starts).astype(np.int32) + 1)
    return np.stack(rows)


def _program(layout, block, scale):
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    from longctx.ops import ring_attention
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "fsdp", "sp"))
    spec = P(None, "sp")

    def local(q, k, v, ids, pos):
        return ring_attention(q, k, v, ids, positions=pos, causal=True, softmax_scale=scale,
                              layout=layout, impl="splash", block_sizes=block)

    attn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)

    def forward_backward(q, k, v, ids, pos, do):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, ids, pos), q, k, v)
        return (out, *vjp(do))

    return jax.jit(attn), jax.jit(forward_backward)


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp

    from longctx.ops import masks
    from longctx.parallel import document_layout
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    S, b, h = args.seq_len, args.batch, args.head_dim
    seg = _segments(S, b, args.documents)
    pos = masks.segment_positions(seg)
    rng = np.random.default_rng(0)
    natural = {name: jnp.asarray(rng.standard_normal((b, S, n, h)), jnp.bfloat16)
               for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("do", heads))}
    laid, perm = document_layout.permute_rows({"segment_ids": seg, "positions": pos}, 1, args.block)
    take = lambda x: jnp.take_along_axis(x, jnp.asarray(perm)[:, :, None, None], axis=1)  # noqa: E731
    inputs = {"contiguous": (natural["q"], natural["k"], natural["v"], jnp.asarray(seg),
                             jnp.asarray(pos), natural["do"]),
              "per_document": (take(natural["q"]), take(natural["k"]), take(natural["v"]),
                               jnp.asarray(laid["segment_ids"]), jnp.asarray(laid["positions"]),
                               take(natural["do"]))}
    programs = {layout: _program(layout, args.block, h ** -0.5) for layout in LAYOUTS}
    results = {layout: {"fwd_s": [], "fwdbwd_s": []} for layout in LAYOUTS}
    outs = {}
    for layout in LAYOUTS:  # compile and check
        t0 = time.perf_counter()
        outs[layout] = jax.block_until_ready(programs[layout][1](*inputs[layout]))
        results[layout]["compile_s"] = round(time.perf_counter() - t0, 1)
    back = jnp.asarray(np.argsort(perm, axis=1))[:, :, None, None]
    errors = {name: float(jnp.max(jnp.abs(jnp.take_along_axis(p.astype(jnp.float32), back, axis=1)
                                          - n.astype(jnp.float32))) / jnp.max(jnp.abs(n.astype(jnp.float32))))
              for name, p, n in zip(("out", "dq", "dk", "dv"), outs["per_document"], outs["contiguous"])}
    for _ in range(args.rounds):  # interleaved, so that drift falls on both
        for layout in LAYOUTS:
            forward, both = programs[layout]
            results[layout]["fwd_s"].append(bc.median_seconds(forward, inputs[layout][:5], args.reps))
            results[layout]["fwdbwd_s"].append(bc.median_seconds(both, inputs[layout], args.reps))
    for r in results.values():
        r["fwd_ms"] = round(1e3 * statistics.median(r.pop("fwd_s")), 3)
        r["fwdbwd_ms"] = round(1e3 * statistics.median(r.pop("fwdbwd_s")), 3)
    return {"layouts": results, "relative_difference": errors,
            "settings": {"seq_len": S, "batch": b, "heads": heads, "kv_heads": kv_heads, "head_dim": h,
                         "block": args.block, "documents": args.documents, "reps": args.reps,
                         "rounds": args.rounds}}


def markdown(result: dict) -> str:
    s, lay = result["settings"], result["layouts"]
    ratio = {k: lay["per_document"][k] / lay["contiguous"][k] for k in ("fwd_ms", "fwdbwd_ms")}
    rows = [[layout, f"{lay[layout]['fwd_ms']:,.2f}", f"{lay[layout]['fwdbwd_ms']:,.2f}",
             f"{lay[layout]['compile_s']:.1f}"] for layout in LAYOUTS]
    within = all(abs(r - 1) <= 0.03 for r in ratio.values())
    return "\n".join([
        "# The per-document layout on one TPU chip (sp=1)", "",
        f"Generated by `{result['command']}` on {result['machine']['device']} "
        f"({result['machine']['date_utc']} UTC, jax {result['machine']['jax']}). ring_attention, "
        f"impl=splash, causal with documents: {s['batch']} rows of {s['seq_len']:,} tokens, "
        f"{s['documents']} documents each at random cuts, {s['heads']}/{s['kv_heads']} heads of "
        f"{s['head_dim']}, bf16, blocks of {s['block']}; median of {s['reps']} runs, the two layouts "
        f"interleaved over {s['rounds']} rounds (the median of the rounds' medians).", "",
        bc.table(["layout", "forward ms", "forward + backward ms", "compile s"], rows), "",
        f"per_document / contiguous: forward {ratio['fwd_ms']:.3f}x, forward + backward "
        f"{ratio['fwdbwd_ms']:.3f}x (target: within 3%: {'met' if within else 'MISSED'}). Output and "
        "gradients put back in natural order differ from the natural order's by at most "
        + ", ".join(f"{k} {v:.1e}" for k, v in result["relative_difference"].items())
        + " (relative to the largest; bf16).", ""])


def main(argv=None):
    args = _arguments(argv)
    if bc.render_only(args, markdown):
        return 0
    cli.validated(f"sp=1 at {args.seq_len:,} tokens")
    import jax
    if jax.devices()[0].platform != "tpu":
        raise SystemExit("bench_tpu_per_document.py measures the chip's kernels: run it on a TPU host.")
    result = measure(args)
    machine = bc.machine()
    machine["device"] = jax.devices()[0].device_kind
    result.update(command=bc.command_line(), machine=machine)
    bc.write_json(args.json, result)
    bc.write_markdown(args.md, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    cli.run(main)
