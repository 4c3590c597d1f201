"""bf16 accuracy of the ring against plain single-device splash: both on the same bf16 inputs,
both measured against the dense float32 oracle (the ring's error must be no larger).

  .venv/bin/python benchmarks/bench_bf16_error.py            # S = 4096, sp = 4, causal and 9 documents/row

Inputs: q, k, v and the output cotangent drawn float32 standard normal and rounded to bf16; 4
heads of head_dim 64, so the softmax scale 1/8 is a power of two and scaling q is exact in
bf16 (neither program adds a rounding of its own there). Programs, forward + vjp, bf16 in and
out, block 512:
  single         splash's public make_splash_mha on one device (the whole sequence, sp = 1;
                 fused backward), vmapped over the batch;
  ring <layout>  longctx ring_attention, impl=splash, on sp devices, every layout.
Oracle: longctx.ops.reference_attention in float32 on the same bf16 values. For out, dq, dk and
dv: the mean, root-mean-square and largest absolute error of each program over all elements,
each ring's ratio to single's, and, element by element, the fraction of elements where the
ring's error is larger than single's. Writes docs/bench_bf16_error.json and its section of
docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # noqa: E402
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_common as bc  # noqa: E402
from longctx.parallel import layout as layout_lib  # noqa: E402
from longctx.ops import reference_attention, ring_attention  # noqa: E402

HEADS, HEAD_DIM = 4, 64
CASES = {"causal": "causal", "docs9": "causal + 9 documents per row (8 random cuts)"}
SCALE = HEAD_DIM ** -0.5  # 1/8
NAMES = ("out", "dq", "dk", "dv")


def make_inputs(case, batch, seq_len, seed):
    """bf16 q, k, v, dout [b, S, heads, head_dim]; natural-order segment ids [b, S] or None."""
    rng = np.random.default_rng(seed)
    draw = lambda: jnp.asarray(rng.standard_normal((batch, seq_len, HEADS, HEAD_DIM), np.float32),  # noqa: E731
                               jnp.bfloat16)
    q, k, v, dout = draw(), draw(), draw(), draw()
    seg = None
    if case == "docs9":  # 9 documents per row, 8 random cuts
        starts = np.zeros((batch, seq_len), np.int32)
        starts[:, 0] = 1
        for r in range(batch):
            starts[r, rng.choice(np.arange(1, seq_len), 8, replace=False)] = 1
        seg = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
    return q, k, v, dout, seg


def _fwd_bwd(attention, q, k, v, dout):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(dout))


def oracle(q, k, v, dout, seg):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    attention = lambda q, k, v: reference_attention(q, k, v, seg, causal=True)  # noqa: E731
    return jax.jit(_fwd_bwd, static_argnums=0)(attention, f32(q), f32(k), f32(v), f32(dout))


def single_device(q, k, v, dout, seg, block):
    """Splash's own kernel on the whole sequence: [heads, S, head_dim] per row, q pre-scaled."""
    seq_len = q.shape[1]
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len))] * HEADS)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                interpret=True)
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731

    def attention(q, k, v):
        def row(q1, k1, v1, seg1):
            ids = None if seg1 is None else sk.SegmentIds(q=seg1, kv=seg1)
            return kernel(q1, k1, v1, segment_ids=ids)
        rows = jax.vmap(row, in_axes=(0, 0, 0, None if seg is None else 0))
        # scaling by 1/8 is exact in bf16, as the ring's own pre-scaling is
        return heads_major(rows(heads_major(q * jnp.asarray(SCALE, q.dtype)), heads_major(k),
                                heads_major(v), seg))

    return jax.jit(_fwd_bwd, static_argnums=0)(attention, q, k, v, dout)


def ring(q, k, v, dout, seg, sp, layout, block):
    mesh = bc.sp_mesh(sp)
    data = P(None, "sp")
    perm = layout_lib.permutation(layout, q.shape[1], sp)
    put = lambda x: None if x is None else jax.device_put(x[:, perm], NamedSharding(mesh, data))  # noqa: E731

    def per_shard(q, k, v, seg):
        return ring_attention(q, k, v, seg, causal=True, layout=layout, impl="splash",
                              block_sizes=block)

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(data,) * 3 + (None if seg is None else data,),
                      out_specs=data)
    seg_l = put(seg)
    got = jax.jit(_fwd_bwd, static_argnums=0)(
        lambda q, k, v: f(q, k, v, seg_l), put(q), put(k), put(v), put(dout))
    back = layout_lib.inverse_permutation(perm)
    return [x[:, back] for x in got]


def abs_errors(got, want):
    """|got - want| per element, float64, for out, dq, dk, dv."""
    errs = []
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == jnp.bfloat16, (name, g.dtype)
        errs.append(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)))
    return errs


def summary(errs, single_errs=None):
    """Mean, RMS and largest error per tensor; against single's errors, element by element, the
    fraction of elements where this program's error is larger ("worse") and bitwise equal."""
    res = {}
    for i, (name, err) in enumerate(zip(NAMES, errs)):
        res[name] = {"mean": float(err.mean()), "rms": float(np.sqrt((err ** 2).mean())),
                     "max": float(err.max())}
        if single_errs is not None:
            res[name]["worse"] = float((err > single_errs[i]).mean())
    return res


def markdown(result):
    s = result["settings"]
    lines = ["## bf16 error: the ring against single-device splash (`bench_bf16_error.py`)", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']['date_utc']} UTC, jax {result['machine']['jax']}, "
             f"{result['machine']['cpu_count']} CPUs.  ",
             f"S = {s['seq_len']}, batch {s['batch']}, {s['heads']} heads x {s['head_dim']}, "
             f"block {s['block']}; bf16 inputs and outputs, errors against the dense "
             "float32 oracle on the same bf16 values. ratio = ring / single (<= 1: the ring is no "
             "less accurate); elements worse: the fraction of elements whose error is larger "
             "than single's for the same element.", ""]
    for case, progs in result["cases"].items():
        single = progs["single"]
        rows = []
        for prog, errs in progs.items():
            for name in NAMES:
                e = errs[name]
                ratio = lambda m: "" if prog == "single" else f"{e[m] / single[name][m]:.3f}"  # noqa: E731
                worse = "" if prog == "single" else f"{e['worse']:.2%}"
                rows.append([prog, name, f"{e['mean']:.3e}", ratio("mean"), f"{e['rms']:.3e}",
                             ratio("rms"), f"{e['max']:.3e}", ratio("max"), worse])
        lines += [f"**{CASES[case]}**", "",
                  bc.table(["program", "tensor", "mean abs err", "ratio", "rms err", "ratio",
                            "max abs err", "ratio", "elements worse than single"], rows), ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--seed", type=int, default=0)
    bc.add_output_arguments(ap, "bench_bf16_error")
    args = ap.parse_args()
    if jax.device_count() < args.sp:
        ap.error(f"--sp {args.sp} needs {args.sp} devices, have {jax.device_count()}")
    result = {"command": bc.command_line(), "machine": bc.machine(),
              "settings": {"seq_len": args.seq_len, "batch": args.batch, "sp": args.sp,
                           "block": args.block, "heads": HEADS, "head_dim": HEAD_DIM},
              "cases": {}}
    cases = [c for c in args.cases.split(",") if c]
    if not set(cases) <= set(CASES):
        ap.error(f"--cases: choose from {', '.join(CASES)}")
    cli.validated(f"the flags are fine ({len(cases)} case(s) on sp={args.sp})")
    for case in cases:
        x = make_inputs(case, args.batch, args.seq_len, args.seed)
        want = oracle(*x)
        single = abs_errors(single_device(*x, args.block), want)
        progs = {"single": summary(single)}
        for layout in layout_lib.LAYOUTS:
            progs[f"ring {layout}"] = summary(abs_errors(ring(*x, args.sp, layout, args.block), want),
                                              single)
        result["cases"][case] = progs
        for prog, errs in progs.items():
            print(case, f"{prog:16s}", "  ".join(f"{n} mean {errs[n]['mean']:.3e} max {errs[n]['max']:.3e}"
                                                 for n in NAMES), flush=True)
    bc.write_json(args.json, result)
    bc.write_section("bench_bf16_error", markdown(result), args.md)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    cli.run(main)
