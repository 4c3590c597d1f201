"""Attention kernels side by side on one TPU chip: longctx's path against stock splash and
MaxText's tokamax splash, same inputs, same run.

  longctx   ops.ring_attention on a one-device mesh (sp=1, contiguous, impl=splash): the
            kernels of ops/splash_kernels.py with the ring's tables around them
  stock     jax.experimental.pallas.ops.tpu.splash_attention (CausalMask / LocalMask / FullMask;
            segment ids for documents), fused backward, as many keys computed at a time as
            longctx's kernels (ops.ring.compute_block)
  tokamax   MaxText 0.2.5's kernels.tokamax_splash_attention, the same settings (where it is
            importable: `bash ../shared/tpu/fetch-wheels.sh` puts it on the TPU host's path)

bf16, batch 1, heads-major for the splash kernels; time of jit(vjp) forward + backward and of
the forward alone, median of --reps after a compile. TFLOP/s count the pairs the mask keeps
(causal half and the diagonal, a window its band, documents their own squares): 4 x pairs x
heads x head_dim for the forward, 3.5x that for forward + backward; % of peak against the chip's
bf16 peak. Stock and tokamax run at the compiler's default scoped VMEM and, in a second process,
at MaxText's raised limit (`--xla_tpu_scoped_vmem_limit_kib=98304` in LIBTPU_INIT_ARGS); longctx
sets its own limit from the chip (ops/splash_kernels.vmem_limit_bytes). With --check, output and
gradients against a float32 reference at the first length, relative max error beside stock's.

On a TPU VM (docs/tpu.md):
  .venv/bin/python benchmarks/bench_tpu_kernels.py --seqs 32768,65536
Writes docs/tpu_kernels.json (a later run replaces the rows it measures and keeps the others) and
docs/tpu_kernels.md, and the chip's longctx timings into longctx/plan/tpu_block_timings.json, from
which `attention.block_size=auto` takes the fastest block on that chip (plan/measured_blocks.py).
Each row is written to those files as soon as it is measured, so that a run cut short (a
`timeout`, the TPU VM's lease) keeps every row it finished.
Nothing here runs on CPU: the kernels' speed is the chip's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from longctx import cli  # noqa: E402
from longctx.plan import measured_blocks  # noqa: E402

RAISED_VMEM_KIB = 98304
WINDOW = 4096
DOCUMENTS = 32
# documents: DOCUMENTS per row at random cuts; one_document: segment ids that one document fills,
# a causal row's blocks through the document path (what a packed row of one long file costs)
MASKS = ("causal", "window", "documents", "one_document", "full")
KEY = ("impl", "vmem", "mask", "S", "heads", "kv_heads", "head_dim", "block")
RUN = time.strftime("%Y-%m-%d %H:%M", time.gmtime())  # rows measured in one invocation share it
# what a measuring process prints for the parent: its chip, then each row as it is measured
DEVICE, ROW = "DEVICE ", "ROW "


def _arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="32768,65536")
    p.add_argument("--masks", default="causal,window,documents,full",
                   help=f"comma separated, of {', '.join(MASKS)}")
    p.add_argument("--impls", default="longctx,stock,tokamax")
    p.add_argument("--blocks", default="512,1024,2048")
    p.add_argument("--heads", default="8/8,32/8", help="query heads / kv heads, comma separated")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vmem", choices=("default", "raised", "both"), default="both",
                   help="stock and tokamax's scoped VMEM limit (longctx sets its own)")
    p.add_argument("--check", action="store_true", help="errors against float32 at the first S")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="start no new measurement after this many seconds")
    bc.add_page_arguments(p, "tpu_kernels")
    p.add_argument("--block-table", default=measured_blocks.TABLE,
                   help="where attention.block_size=auto reads the chip's timings")
    p.add_argument("--child", choices=("default", "raised"), help=argparse.SUPPRESS)
    p.add_argument("--run", default=RUN, help=argparse.SUPPRESS)  # the parent's, for its children
    args = p.parse_args(argv)
    unknown = sorted(set(args.masks.split(",")) - set(MASKS))
    if unknown:
        p.error(f"--masks {args.masks}: {', '.join(unknown)} is not a mask this benchmark runs; "
                f"choose from {', '.join(MASKS)}")
    return args


# ----------------------------------------------------------------------------- measuring (chip)

def _segments(S):
    rng = np.random.default_rng(S)
    cuts = np.sort(rng.choice(np.arange(1, S), size=DOCUMENTS - 1, replace=False))
    starts = np.zeros(S, np.int32)
    starts[cuts] = 1
    return np.cumsum(starts).astype(np.int32) + 1


def _document_ids(mask, S):
    """The row's segment ids under `mask`, None for the masks without documents."""
    if mask == "documents":
        return _segments(S)
    return np.ones(S, np.int32) if mask == "one_document" else None


def _pairs(mask, S, seg):
    i = np.arange(S, dtype=np.int64)
    if mask == "full":
        return S * S
    if mask == "window":
        return int(np.sum(np.minimum(i, WINDOW) + 1))
    if seg is None:
        return S * (S + 1) // 2
    _, counts = np.unique(seg, return_counts=True)
    return int(np.sum(counts.astype(np.int64) * (counts + 1) // 2))


def _mask(masks, mask, window, S):
    """One head's mask from a splash mask module (stock's or tokamax's: the same classes)."""
    if mask == "full":
        return masks.FullMask((S, S))
    if window:
        return masks.LocalMask((S, S), window_size=(window, 0), offset=0)
    return masks.CausalMask((S, S))


def _attention(impl, mask, S, block, seg, heads, head_dim):
    """attn(q, k, v): [S, heads, head_dim] -> [S, heads, head_dim], or None where `impl` is
    not importable here."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    causal, window = mask != "full", WINDOW if mask == "window" else None
    ids = None if seg is None else jnp.asarray(seg)
    scale = head_dim ** -0.5
    if impl == "longctx":
        from longctx.ops import ring_attention
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "fsdp", "sp"))
        spec = P(None, "sp")

        def local(q, k, v, *s):
            return ring_attention(q, k, v, *s, causal=causal, sliding_window=window,
                                  softmax_scale=scale, layout="contiguous", impl="splash",
                                  block_sizes=block)

        documents = () if ids is None else (ids[None],)
        f = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 + len(documents)),
                          out_specs=spec, check_vma=False)
        return lambda q, k, v: f(q[None], k[None], v[None], *documents)[0]
    from longctx.ops.ring import compute_block
    compute = compute_block(block)
    if impl == "stock":
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
        one = _mask(sm, mask, window, S)
        sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=compute,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=compute, use_fused_bwd_kernel=True)
        make = lambda heads: sk.make_splash_mha(sm.MultiHeadMask([one] * heads),  # noqa: E731
                                                block_sizes=sizes, head_shards=1, q_seq_shards=1)
        segments = None if ids is None else sk.SegmentIds(ids, ids)
    elif impl == "tokamax":
        try:
            from maxtext.kernels.tokamax_splash_attention import base as tb
            from maxtext.kernels.tokamax_splash_attention import splash_attention_kernel as tk
            from maxtext.kernels.tokamax_splash_attention import splash_attention_mask as tm
        except ImportError:
            return None
        one = _mask(tm, mask, window, S)
        config = tk.SplashConfig(block_q=block, block_kv=block, block_kv_compute=compute,
                                 block_q_dkv=block, block_kv_dkv=block,
                                 block_kv_dkv_compute=compute, use_fused_bwd_kernel=True)
        make = lambda heads: tk.make_splash_mha(one, config=config, q_seq_shards=1)  # noqa: E731
        segments = None if ids is None else tb.SegmentIds(ids, ids)
    else:
        raise ValueError(impl)
    kernel = make(heads)  # built outside any trace: its mask tables are constants

    def attn(q, k, v):
        q = (q * scale).transpose(1, 0, 2)
        if impl == "stock":
            o = kernel(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), segment_ids=segments)
        else:
            o = kernel(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), segments)
        o = o[0] if isinstance(o, tuple) else o
        return o.transpose(1, 0, 2)
    return attn


def _reference(mask, S, seg, q, k, v, do):
    """float32, highest precision: (out, dq, dk, dv)."""
    import jax
    import jax.numpy as jnp
    scale = q.shape[-1] ** -0.5
    i = jnp.arange(S)
    allowed = jnp.ones((S, S), bool)
    if mask != "full":
        allowed &= i[None, :] <= i[:, None]
    if mask == "window":
        allowed &= i[None, :] >= i[:, None] - WINDOW
    if seg is not None:
        allowed &= jnp.asarray(seg)[:, None] == jnp.asarray(seg)[None, :]
    per_kv = q.shape[1] // k.shape[1]

    def attend(q, k, v):
        with jax.default_matmul_precision("highest"):
            k, v = jnp.repeat(k, per_kv, axis=1), jnp.repeat(v, per_kv, axis=1)
            s = jnp.einsum("qhd,khd->hqk", q, k) * scale
            p = jax.nn.softmax(jnp.where(allowed[None], s, -jnp.inf), axis=-1)
            return jnp.einsum("hqk,khd->qhd", p, v)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out, vjp = jax.vjp(attend, f32(q), f32(k), f32(v))
    return (out, *vjp(f32(do)))


def measure(args, vmem: str) -> None:
    """Measures and prints this process's rows, each as it is done (stock and tokamax at `vmem`;
    longctx, its limit being its own, only in the first process: the default one under --vmem
    both)."""
    import jax
    import jax.numpy as jnp
    device = jax.devices()[0]
    from longctx.plan import hardware
    chip = hardware.chip_for_device_kind(device.device_kind)
    if chip is None:
        raise SystemExit(f"{device.device_kind} is not a TPU chip this script knows: run it on a "
                         "TPU host (docs/tpu.md)")
    peak = chip.peak_flops
    print(f"{DEVICE}{device.device_kind}", flush=True)
    print(f"device {device.device_kind}, scoped VMEM {vmem}, peak {peak / 1e12:.0f} TFLOP/s",
          flush=True)
    first = "default" if args.vmem == "both" else args.vmem  # longctx's one process
    impls = [i for i in args.impls.split(",") if i != "longctx" or vmem == first]
    start = time.perf_counter()
    seqs = [int(s) for s in args.seqs.split(",")]
    for heads, kv_heads in (tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")):
        for S in seqs:
            rng = np.random.default_rng(S)
            draw = lambda n: jnp.asarray(  # noqa: E731
                rng.standard_normal((S, n, args.head_dim), np.float32), jnp.bfloat16)
            q, k, v, do = draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)
            for mask in args.masks.split(","):
                seg = _document_ids(mask, S)
                pairs = _pairs(mask, S, seg)
                flops = 4.0 * pairs * heads * args.head_dim
                reference = None
                if args.check and S == seqs[0]:
                    reference = [np.asarray(x) for x in jax.jit(
                        lambda *a: _reference(mask, S, seg, *a))(q, k, v, do)]
                for impl in impls:
                    for block in (int(b) for b in args.blocks.split(",")):
                        if time.perf_counter() - start > args.budget_s:
                            print("budget spent: stopping", flush=True)
                            return
                        row = dict(run=args.run, impl=impl,
                                   vmem=vmem if impl != "longctx" else "own",
                                   mask=mask, S=S, heads=heads, kv_heads=kv_heads,
                                   head_dim=args.head_dim, block=block, pairs=pairs)
                        row.update(_one(impl, mask, S, block, seg, (q, k, v, do), flops, peak,
                                        reference, args))
                        print(ROW + json.dumps(row), flush=True)


def _one(impl, mask, S, block, seg, operands, flops, peak, reference, args) -> dict:
    import jax
    q, k, v, do = operands
    try:
        attn = _attention(impl, mask, S, block, seg, q.shape[1], args.head_dim)
        if attn is None:
            return dict(error="not importable here")
        forward = jax.jit(attn)

        @jax.jit
        def forward_backward(q, k, v, do):
            out, vjp = jax.vjp(attn, q, k, v)
            return (out, *vjp(do))

        t0 = time.perf_counter()
        outs = jax.block_until_ready(forward_backward(q, k, v, do))
        result = dict(compile_s=round(time.perf_counter() - t0, 1))
        fwd = bc.median_seconds(forward, (q, k, v), args.reps)
        both = bc.median_seconds(forward_backward, (q, k, v, do), args.reps)
        result.update(fwd_ms=round(fwd * 1e3, 3), fwdbwd_ms=round(both * 1e3, 3),
                      fwd_tflops=round(flops / fwd / 1e12, 1),
                      fwdbwd_tflops=round(3.5 * flops / both / 1e12, 1),
                      pct_peak=round(100 * 3.5 * flops / both / peak, 1))
        if reference is not None:
            result["rel_err"] = {
                name: float(np.max(np.abs(np.asarray(g, np.float32) - r)) / np.max(np.abs(r)))
                for name, g, r in zip(("out", "dq", "dk", "dv"), outs, reference)}
        return result
    except Exception as e:  # a block that does not compile is a result too
        traceback.print_exc(limit=2)
        return dict(error=(type(e).__name__ + ": " + str(e)).splitlines()[0][:300])


# ----------------------------------------------------------------------------- the page

def _best(rows, **match):
    """The fastest fwd+bwd row matching `match`, over blocks and VMEM settings."""
    ok = [r for r in rows if "fwdbwd_ms" in r and all(r[k] == v for k, v in match.items())]
    return min(ok, key=lambda r: r["fwdbwd_ms"]) if ok else None


def _ms(r):
    return "—" if r is None else (
        f"{r['fwdbwd_ms']:.1f} ({r['block']}{', raised VMEM' if r['vmem'] == 'raised' else ''})")


def _ratio(a, b):
    return "—" if a is None or b is None else f"{a['fwdbwd_ms'] / b['fwdbwd_ms']:.2f}"


def _shape(r):
    """A row's attention shape: query heads, K/V heads, head width."""
    return r["heads"], r["kv_heads"], r["head_dim"]


def _heads(shape):
    """(heads, kv_heads, head_dim) as the page writes it."""
    heads, kv_heads, head_dim = shape
    return f"{heads}/{kv_heads} x {head_dim}"


def markdown(data) -> str:
    rows = data["rows"]
    lines = ["# Attention kernels on a TPU chip", "",
             "Measured on the chip by `benchmarks/bench_tpu_kernels.py` (its docstring says how); "
             "forward + backward of jit(vjp), bf16, batch 1, median of the repeats; TFLOP/s "
             "count the pairs each mask keeps (forward 4 x pairs x heads x head_dim, forward + "
             "backward 3.5x that). Ratios below 1: longctx is faster.", "",
             f"Device: {data.get('device', '?')}. Runs (each row names its run):", ""]
    lines += [f"    {c}" for c in data.get("commands", [])]
    names = {"window": f"window {WINDOW:,}", "one_document": "one document"}
    label = lambda m: names.get(m, m)  # noqa: E731
    for heads, kv_heads, head_dim in sorted({_shape(r) for r in rows}):
        shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
        lines += ["", f"## {heads} query heads over {kv_heads} K/V heads, head_dim {head_dim}", "",
                  "Side by side: longctx, stock splash and tokamax splash in the same run, at "
                  "the same block; stock and tokamax each at the faster of the scoped VMEM "
                  "limits that run measured (longctx sets its own).", ""]
        table = []
        for r in sorted((r for r in rows if r["impl"] == "longctx" and "fwdbwd_ms" in r
                         and all(r[k] == v for k, v in shape.items())),
                        key=lambda r: (r["S"], MASKS.index(r["mask"]), r["block"])):
            peers = [_best(rows, impl=impl, run=r["run"], S=r["S"], mask=r["mask"],
                           block=r["block"], **shape) for impl in ("stock", "tokamax")]
            if any(peers):
                cells = [c for peer in peers for c in (
                    ("—", "—") if peer is None else (peer["fwdbwd_ms"], peer["vmem"]))]
                table.append([f"{r['S']:,}", label(r["mask"]), r["block"], *cells, r["fwdbwd_ms"],
                              *(_ratio(r, peer) for peer in peers), r["run"]])
        lines.append(bc.table(["S", "mask", "block", "stock ms", "stock VMEM", "tokamax ms",
                               "tokamax VMEM", "longctx ms", "longctx / stock",
                               "longctx / tokamax", "run"], table))
        lines += ["", "Each at its best over the blocks and VMEM limits measured (rows of "
                      "different runs compared: see each row's run).", ""]
        table = []
        for S in sorted({r["S"] for r in rows}):
            for mask in MASKS:
                match = dict(S=S, mask=mask, **shape)
                best = {i: _best(rows, impl=i, **match) for i in ("longctx", "stock", "tokamax")}
                lc = best["longctx"]
                if lc is None:
                    continue
                table.append([f"{S:,}", label(mask), _ms(best["stock"]), _ms(best["tokamax"]),
                              _ms(lc), _ratio(lc, best["stock"]), _ratio(lc, best["tokamax"]),
                              f"{lc['fwdbwd_tflops']} ({lc['pct_peak']}%)"])
        lines.append(bc.table(["S", "mask", "stock ms (block)", "tokamax ms (block)",
                               "longctx ms (block)", "longctx / stock", "longctx / tokamax",
                               "longctx TFLOP/s (% of peak)"], table))
    blocks = sorted({r["block"] for r in rows if r["impl"] == "longctx"})
    per_block = []
    for S, mask, shape in sorted({(r["S"], r["mask"], _shape(r)) for r in rows
                                  if r["impl"] == "longctx"},
                                 key=lambda x: (x[2], x[0], MASKS.index(x[1]))):
        cells = []
        for block in blocks:
            r = _best(rows, impl="longctx", S=S, mask=mask, block=block,
                      **dict(zip(("heads", "kv_heads", "head_dim"), shape)))
            cells.append("—" if r is None else f"{r['fwd_ms']:.1f} / {r['fwdbwd_ms']:.1f}")
        per_block.append([f"{S:,}", label(mask), _heads(shape), *cells])
    lines += ["", "## longctx by block: forward / forward + backward ms", "",
              bc.table(["S", "mask", "heads x head_dim", *(f"block {b}" for b in blocks)],
                       per_block)]
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "## Did not run", "",
                  bc.table(["impl", "VMEM", "mask", "S", "heads x head_dim", "block", "error"],
                           [[r["impl"], r["vmem"], r["mask"], f"{r['S']:,}", _heads(_shape(r)),
                             r["block"], r["error"][:120]]
                            for r in failed])]
    checked = [r for r in rows if "rel_err" in r]
    if checked:
        lines += ["", "## Error against float32 (relative max)", "",
                  bc.table(["impl", "mask", "S", "heads x head_dim", "block", "out", "dq", "dk",
                            "dv"],
                           [[r["impl"], r["mask"], f"{r['S']:,}", _heads(_shape(r)),
                             r["block"], *(f"{r['rel_err'][n]:.2e}" for n in ("out", "dq", "dk", "dv"))]
                            for r in checked])]
    return "\n".join(lines)


def write_block_table(data, path) -> None:
    """The chip's longctx timings, for attention.block_size=auto (the other chips' are kept)."""
    table = measured_blocks.load(path)
    table[data["device"]] = measured_blocks.table_rows(data["rows"])
    bc.write_json(path, table)


def _merge(path, rows, device, command):
    data = json.load(open(path)) if os.path.exists(path) else {"rows": [], "commands": []}
    new = {tuple(r[k] for k in KEY) for r in rows}
    data["rows"] = [r for r in data["rows"] if tuple(r[k] for k in KEY) not in new] + rows
    data["device"] = device or data.get("device")
    if command not in data["commands"]:
        data["commands"].append(command)
    # a run whose rows were all measured again is no longer a source of the page
    runs = {r["run"] for r in data["rows"]}
    data["commands"] = [c for c in data["commands"] if c[1:c.index("]")] in runs]
    return data


def main(argv=None):
    args = _arguments(argv)
    if args.render_only:
        cli.validated(f"--render-only from {args.json}")
    if bc.render_only(args, markdown):
        return
    if not args.child:
        cli.validated(f"the flags are fine ({len(args.seqs.split(','))} length(s), "
                      f"{len(args.masks.split(','))} mask(s), {len(args.blocks.split(','))} block(s))")
    if args.child:
        measure(args, args.child)
        return
    settings = ["default", "raised"] if args.vmem == "both" else [args.vmem]
    rows = []
    for vmem in settings:
        env = dict(os.environ)
        if vmem == "raised":
            env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") +
                                       f" --xla_tpu_scoped_vmem_limit_kib={RAISED_VMEM_KIB}").strip()
        child_args = [a for a in (argv if argv is not None else sys.argv[1:])]
        if vmem == "raised" and args.vmem == "both":  # longctx sets its own limit: measured once
            child_args += ["--impls", ",".join(i for i in args.impls.split(",") if i != "longctx")]
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), *child_args,
                                  "--child", vmem, "--run", args.run], env=env,
                                 stdout=subprocess.PIPE, text=True)
        record(args, child.stdout, rows)
        if child.wait():
            kept = (f"the {len(rows)} rows measured before it are in {args.json}" if rows else
                    "no row was measured")
            raise SystemExit(f"the measuring process ({vmem} VMEM) stopped with exit status "
                             f"{child.returncode}, its reason above; {kept}")
    print(f"wrote {args.json} and {args.md}: {len(rows)} rows measured" if rows else
          "no row measured: nothing written")


def record(args, lines, rows) -> None:
    """Reads a measuring process's output as it comes: each row it prints is added to `rows`,
    printed as a JSON line and written to the page at once; the rest is printed."""
    device = None
    for line in lines:
        if line.startswith(DEVICE):
            device = line[len(DEVICE):].strip()
        elif line.startswith(ROW):
            rows.append(json.loads(line[len(ROW):]))
            print(line[len(ROW):], end="", flush=True)
            save(args, rows, device)
        else:
            print(line, end="", flush=True)


def save(args, rows, device) -> None:
    """The rows measured so far into the page, its JSON and the block table; the command
    carries the run stamp its rows name."""
    data = _merge(args.json, rows, device, f"[{args.run}] {bc.command_line()}")
    bc.write_json(args.json, data)
    bc.write_markdown(args.md, markdown(data))
    write_block_table(data, args.block_table)


if __name__ == "__main__":
    cli.run(main)
