"""Forward+backward time of ring_attention on CPU devices, and its compile time against sp.

  .venv/bin/python benchmarks/bench_attention.py                # the full grid (~15 min on 2 cores)
  .venv/bin/python benchmarks/bench_attention.py --quick        # one small point per variant

For each mask (causal, causal sliding window, chunked causal), sequence length S and ring size
sp, times jit(value_and_grad) of sum(w * attention(q, k, v)) over q, k, v for:
  ring      the ring as the model uses it: layout "auto" (load-balanced for causal), pruned
            steps, empty blocks skipped;
  contig    the same ring on the contiguous layout (unbalanced, still pruned);
  unpruned  the contiguous ring computing every block of every step: ring_attention has no knob
            to switch pruning off, so this runs the same ring with the full (unmasked) mask,
            which computes exactly sp steps x all blocks (the masks' elementwise cost aside);
  dense     longctx.ops.reference_attention on the whole sequence on one device.
impl "xla" everywhere; "splash" (Pallas interpret mode) at the smallest size. Shapes: batch 1,
4 heads (2 kv heads), head_dim 64, float32. Ratios are taken within one run; CPU attention is
elementwise-bound, and the virtual devices share the host's cores, so CPU time measures total
work (pruning), not the ring's critical path (balance); see docs/benchmarks.md.

Compile time: lower+compile of the same fwd+bwd (xla, causal, auto) for sp = 2..16 at fixed
L; with libtpu also the splash ring for TPU topologies of 4 and 16 chips (ahead of time).
Writes docs/bench_attention.json and its section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=16)  # before jax is imported

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_common as bc  # noqa: E402
from longctx.plan import aot  # noqa: E402
from longctx import ops  # noqa: E402
from longctx.ops import reference_attention, ring_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 64, 1


def mask_kwargs(mask: str, seq_len: int, sp: int) -> dict:
    if mask == "causal":
        return dict(causal=True)
    if mask == "window":  # a window of a quarter shard: the ring needs 2 steps
        return dict(causal=True, sliding_window=(seq_len // sp // 4, 0))
    if mask == "chunked":  # one chunk per shard: 1 ring step
        return dict(causal=True, chunk_size=seq_len // sp)
    if mask == "full":
        return dict(causal=False)
    raise ValueError(mask)


def make_mesh(devices):
    return jax.sharding.Mesh(np.array(devices).reshape(1, 1, len(devices)), ("dp", "fsdp", "sp"),
                             axis_types=(AxisType.Auto,) * 3)


def ring_fn(mesh, kw, layout, impl, block):
    spec = P(("dp", "fsdp"), "sp")

    def attention(q, k, v):
        return jax.shard_map(
            lambda q, k, v: ring_attention(q, k, v, layout=layout, impl=impl, block_sizes=block,
                                           **kw),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
    return attention, NamedSharding(mesh, spec)


def dense_fn(kw):
    return lambda q, k, v: reference_attention(q, k, v, **kw)


def fwd_bwd(attention):
    def loss(q, k, v, w):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def inputs(seq_len, sharding=None):
    rng = np.random.default_rng(0)
    shapes = [(BATCH, seq_len, HEADS, HEAD_DIM), (BATCH, seq_len, KV_HEADS, HEAD_DIM),
              (BATCH, seq_len, KV_HEADS, HEAD_DIM), (BATCH, seq_len, HEADS, HEAD_DIM)]
    arrs = [rng.standard_normal(s, np.float32) for s in shapes]
    if sharding is None:
        return [jnp.asarray(a) for a in arrs]
    return [jax.device_put(a, sharding) for a in arrs]


def interleaved(fns, repeats):
    """Compiles and warms every variant, then times them round-robin, `repeats` rounds: a
    change in the machine's background load hits all variants alike. Reports min and median."""
    out = {}
    for name, (f, args) in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        out[name] = {"first_call_s": time.perf_counter() - start, "times_s": []}
    for _ in range(repeats):
        for name, (f, args) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            out[name]["times_s"].append(time.perf_counter() - start)
    for t in out.values():
        t["min_s"] = min(t["times_s"])
        t["median_s"] = float(np.median(t["times_s"]))
    return out


def run_grid(args, result):
    cpu = jax.devices("cpu")
    for impl, sizes, sps, masks_ in args.grid:
        for mask in masks_:
            for S in sizes:
                for sp in sps:  # the dense mask depends on sp for window/chunk: built per sp
                    mesh = make_mesh(cpu[:sp])
                    kw = mask_kwargs(mask, S, sp)
                    # >= 4 kv chunks per shard (room to skip); splash blocks are multiples of 128
                    block = min(args.block, S // sp // 4)
                    if impl == "splash":
                        block = max(128, min(args.block, S // sp // 2))
                    row = {"impl": impl, "mask": mask, "mask_kwargs": {k: v for k, v in kw.items()},
                           "seq_len": S, "sp": sp, "block": block}
                    layout = ops.resolve_layout("auto", S, sp, **kw)
                    row["layout"] = layout
                    variants = [("ring", kw, layout), ("contig", kw, "contiguous"),
                                ("unpruned", mask_kwargs("full", S, sp), "contiguous")]
                    fns = {}
                    for name, vkw, vlayout in variants:
                        attention, sharding = ring_fn(mesh, vkw, vlayout, impl, block)
                        fns[name] = (fwd_bwd(attention), inputs(S, sharding))
                        sched = ops.ring_schedule(S, sp, block, vlayout, **vkw)
                        row[name] = {"layout": vlayout, "ring_steps": sched.steps,
                                     "computed_blocks": int(sched.computed_blocks.sum()),
                                     "efficiency": round(sched.efficiency, 3)}
                    if args.dense and S <= args.dense_max and impl == "xla":
                        fns["dense"] = (fwd_bwd(dense_fn(kw)), inputs(S))
                        row["dense"] = {}
                    for name, t in interleaved(fns, args.repeats).items():
                        row[name].update(t)
                    ring = row["ring"]["min_s"]
                    row["speedup_vs_unpruned"] = row["unpruned"]["min_s"] / ring
                    row["speedup_vs_contig"] = row["contig"]["min_s"] / ring
                    if "dense" in row:
                        row["speedup_vs_dense"] = row["dense"]["min_s"] / ring
                    print(f"  {impl:6s} {mask:8s} S={S:5d} sp={sp:2d} {layout:10s} "
                          f"ring {ring * 1e3:8.1f} ms  contig {row['contig']['min_s'] * 1e3:8.1f}"
                          f"  unpruned {row['unpruned']['min_s'] * 1e3:8.1f}"
                          + (f"  dense {row['dense']['min_s'] * 1e3:8.1f}" if "dense" in row else "")
                          + f"  x{row['speedup_vs_unpruned']:.2f} vs unpruned", flush=True)
                    result["timings"].append(row)
                    bc.write_json(args.json, result)


def compile_times(args, result):
    cpu = jax.devices("cpu")
    L = args.compile_shard_len
    for sp in args.compile_sps:
        if sp > len(cpu):
            continue
        mesh = make_mesh(cpu[:sp])
        attention, sharding = ring_fn(mesh, dict(causal=True), "auto", "xla", min(args.block, L))
        f = fwd_bwd(attention)
        sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
               for a in inputs(L * sp)]
        start = time.perf_counter()
        lowered = f.lower(*sds)
        lower_s = time.perf_counter() - start
        lowered.compile()
        total = time.perf_counter() - start
        result["compile"].append({"platform": "cpu", "impl": "xla", "sp": sp, "seq_len": L * sp,
                                  "lower_s": lower_s, "compile_s": total})
        print(f"  compile cpu xla   sp={sp:2d} S={L * sp:6d}: {total:6.2f}s (lower {lower_s:.2f}s)",
              flush=True)
    if args.tpu_compile and aot.libtpu_available():
        for topo in args.tpu_topologies:
            devices = aot.topology_devices(topo)
            sp = len(devices)
            mesh = make_mesh(devices)
            attention, sharding = ring_fn(mesh, dict(causal=True), "auto", "splash", 512)
            f = fwd_bwd(attention)
            TL = args.tpu_shard_len
            shapes = [(1, TL * sp, 8, 128), (1, TL * sp, 2, 128), (1, TL * sp, 2, 128),
                      (1, TL * sp, 8, 128)]
            sds = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
            start = time.perf_counter()
            f.lower(*sds).compile()
            total = time.perf_counter() - start
            result["compile"].append({"platform": "tpu", "topology": topo, "impl": "splash",
                                      "sp": sp, "seq_len": TL * sp, "compile_s": total})
            print(f"  compile tpu splash {topo} sp={sp:2d} S={TL * sp}: {total:6.2f}s", flush=True)
    bc.write_json(args.json, result)


def critical_paths(r):
    """Blocks on the ring's critical path (sum over run steps of the busiest device's blocks)
    for the row's ring and unpruned variants: what a TPU ring's time follows."""
    kw = dict(r["mask_kwargs"])
    if kw.get("sliding_window") is not None:
        kw["sliding_window"] = tuple(kw["sliding_window"])
    ring = ops.ring_schedule(r["seq_len"], r["sp"], r["block"], r["layout"], **kw)
    contig = ops.ring_schedule(r["seq_len"], r["sp"], r["block"], "contiguous", **kw)
    full = ops.ring_schedule(r["seq_len"], r["sp"], r["block"], "contiguous", causal=False)
    return ring.critical_path, contig.critical_path, full.critical_path


def markdown(result) -> str:
    out = ["## Attention: ring fwd+bwd time on CPU devices, compile time vs sp "
           "(`bench_attention.py`)\n", f"Command: `{result['command']}`  ",
           f"Machine: {result['machine']['cpu_count']} CPU cores, {result['machine']['devices']} "
           f"virtual devices, jax {result['machine']['jax']}. batch {BATCH}, {HEADS} heads "
           f"({KV_HEADS} kv heads) x {HEAD_DIM}, float32; value_and_grad over q, k, v. Times: the "
           f"fastest of {result['repeats']} runs, the variants of a row timed round-robin after "
           "a compile+warm-up call each (the host is shared, so the minimum is the least "
           "disturbed). Ring block (= XLA kv chunk) min(512, L/4), splash max(128, L/2).\n",
           "Variants: **ring** = layout auto (balanced for causal), pruned ring, empty blocks "
           "skipped; **contig** = same ring on the contiguous layout; **unpruned** = contiguous "
           "ring computing every block of every ring step (ring_attention has no pruning switch, "
           "so it is the same ring with the full mask: identical step and block count to a "
           "switched-off pruning, minus the mask's elementwise cost); **dense** = "
           "`reference_attention` on one device. window = causal sliding window of L/4; "
           "chunked = chunk of L (one ring step).\n"]
    rows = []
    for r in result["timings"]:
        rows.append([r["impl"], r["mask"], r["seq_len"], r["sp"], r["block"], r["layout"],
                     f"{r['ring']['ring_steps']}/{r['unpruned']['ring_steps']}",
                     f"{r['ring']['min_s'] * 1e3:.0f}", f"{r['contig']['min_s'] * 1e3:.0f}",
                     f"{r['unpruned']['min_s'] * 1e3:.0f}",
                     f"{r['dense']['min_s'] * 1e3:.0f}" if "dense" in r else "-",
                     f"{r['speedup_vs_unpruned']:.2f}x",
                     f"{r['speedup_vs_dense']:.2f}x" if "speedup_vs_dense" in r else "-",
                     "{2}/{0} = {3:.2f}x".format(*(cp := critical_paths(r)), cp[2] / cp[0])])
    out.append(bc.table(["impl", "mask", "S", "sp", "block", "layout", "steps ring/unpruned", "ring ms",
                         "contig ms", "unpruned ms", "dense ms", "ring vs unpruned",
                         "ring vs dense", "critical-path blocks unpruned/ring (TPU model)"], rows))
    out.append("\n### Compile time vs sp\n")
    crow = [[c["platform"], c["impl"], c.get("topology", "-"), c["sp"], c["seq_len"],
             f"{c['compile_s']:.1f}"] for c in result["compile"]]
    out.append(bc.table(["platform", "impl", "topology", "sp", "S", "lower+compile s"], crow))
    out.append("\n### Targets\n")
    for t in result["targets"]:
        out.append(f"- {t}")
    return "\n".join(out) + "\n"


def targets(result):
    lines = []
    causal8 = [r for r in result["timings"] if r["mask"] == "causal" and r["sp"] == 8]
    for r in causal8:
        s = r["speedup_vs_unpruned"]
        ring_cp, _, full_cp = critical_paths(r)
        lines.append(f"causal, {r['impl']}, S={r['seq_len']}, sp=8: balanced ring "
                     f"{s:.2f}x faster than the unbalanced unpruned ring on CPU (target >= 1.6x: "
                     f"{'met' if s >= 1.6 else 'MISSED'}); critical path on a TPU ring "
                     f"{full_cp}/{ring_cp} blocks = {full_cp / ring_cp:.2f}x fewer")
    for plat in ("cpu", "tpu"):
        c = {x["sp"]: x["compile_s"] for x in result["compile"] if x["platform"] == plat}
        if 4 in c and 16 in c:
            ratio = c[16] / c[4]
            lines.append(f"compile time {plat}: sp=16 {c[16]:.1f}s vs sp=4 {c[4]:.1f}s = "
                         f"{ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--no-dense", dest="dense", action="store_false")
    ap.add_argument("--dense-max", type=int, default=8192, help="largest S for the dense oracle")
    ap.add_argument("--no-tpu-compile", dest="tpu_compile", action="store_false")
    bc.add_output_arguments(ap, "bench_attention", "rewrite the markdown section from --json without running")
    args = ap.parse_args()
    cli.validated("the flags are fine")
    if args.render_only:
        import json
        result = json.load(open(args.json))
        result["targets"] = targets(result)
        bc.write_json(args.json, result)
        bc.write_section("bench_attention", markdown(result), args.md)
        return
    if args.quick:
        args.grid = [("xla", [1024], [4], ["causal"])]
        args.repeats = 1
        args.block = 128
        args.compile_sps, args.compile_shard_len = [2, 4], 256
        args.tpu_compile = False
    else:
        args.grid = [("xla", [2048, 8192], [4, 8], ["causal", "window", "chunked"]),
                     ("splash", [2048], [8], ["causal"])]
        args.compile_sps, args.compile_shard_len = [2, 4, 8, 16], 1024
        args.tpu_topologies, args.tpu_shard_len = ["v5p:2x2x1", "v5p:2x2x4"], 8192
    result = {"command": bc.command_line(), "machine": bc.machine(), "repeats": args.repeats,
              "timings": [], "compile": [], "targets": []}
    print("fwd+bwd times:", flush=True)
    run_grid(args, result)
    print("compile times:", flush=True)
    compile_times(args, result)
    result["targets"] = targets(result)
    bc.write_json(args.json, result)
    bc.write_section("bench_attention", markdown(result), args.md)
    for t in result["targets"]:
        print(t)


if __name__ == "__main__":
    cli.run(main)
