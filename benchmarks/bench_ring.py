"""The ring on its benchmark work (causal rows of one document, packed documents, GQA, a window):
fwd+bwd time of every longctx impl x layout,
with and without document skipping, optionally beside other JAX rings, every result checked.

  .venv/bin/python benchmarks/bench_ring.py --peers /tmp/peers      # the table: S = 2048, 8192, with peers
                                                       # (13 min on 2 shared cores)
  .venv/bin/python benchmarks/bench_ring.py                         # the same without peers
  .venv/bin/python benchmarks/bench_ring.py --quick                 # S = 2048, one run, no peers
  .venv/bin/python benchmarks/bench_ring.py --render-only           # rewrite the markdown from the JSON

Cases (sp = 4, 4 heads x head_dim 64, block 512 at most L = S/sp, and at most L/2 for zigzag,
whose shard is two halves from opposite ends of the sequence: a block across both would be
computed whole (masks.default_block_size); float32, batch 1 unless said):
  causal     causal
  docs9      causal + 9 documents per row (8 random cuts, none on a shard boundary), batch 2
  docs_s32   causal + documents of mean length S/32 (31 random cuts)
  gqa        causal, GQA: 4 query heads, 2 kv heads
  window     causal sliding window of 256: token i sees i-256..i (sliding_window=(256, 0))

Variants: longctx ring_attention for every impl (splash: the Pallas kernel in interpret mode
off TPU; xla) x layout (contiguous, zigzag, striped); on the document cases also the same ring
with skip_documents=False (document masking element-wise only: what the block skipping buys).
With `--peers DIR` (a `pip install --target` directory: maxtext==0.2.5, ringattention==0.1.2,
einops, all --no-deps), on the contiguous layout:
  maxtext        maxtext.kernels.tokamax_splash_attention.ring_attention_kernel.
                 make_ring_attention (MaxText's tokamax splash ring; fused backward; kernel in
                 interpret mode), vmapped over the batch as MaxText's call_ring_attention does,
                 SegmentIds for documents;
  ringattention  lhao499's ringattention.ringattention_jax.ring_attention (blockwise XLA; causal
                 via causal_block_size=1, query/key chunks = block; its segment-id mask slices
                 the ids at global offsets, so it is given the whole row's ids, replicated).
A peer that cannot express a case, or fails, is recorded as such; the run goes on. Peer code is
imported from DIR only by this script (never by longctx).

Each variant is jit(forward + vjp) inside jax.shard_map over the sp axis, on inputs already
permuted into its layout (the data pipeline's job, not the attention's: not timed). Its first
call after compiling gives the output and dq, dk, dv, which are permuted back and checked
against longctx.ops.reference_attention (dense float32, natural order; computed per batch row
and query head to bound memory) at S <= --check-up-to; then the variants of a (case, S) are
timed round-robin, one run each in turn for N rounds, so that machine noise hits all alike;
the median wall time and the median process CPU time (all threads: the work, less sensitive to
other jobs) are reported, with the blocks each longctx variant computes (from ops/tables.py).
Writes docs/bench_ring.json and the bench_ring section of docs/benchmarks.md (the report:
bench_ring_report.py, which --render-only reruns on the JSON).
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_common as bc  # noqa: E402
import bench_ring_report as report  # noqa: E402
from longctx.parallel import layout as layout_lib  # noqa: E402
from longctx.ops import masks  # noqa: E402
from longctx.ops import tables  # noqa: E402
from longctx.errors import MissingFileError  # noqa: E402
from longctx.ops import reference_attention, ring_attention  # noqa: E402

HEADS, HEAD_DIM = 4, 64
IMPLS = ("splash", "xla")
LAYOUTS = layout_lib.LAYOUTS
PEERS = report.PEERS
FWD_TOL = dict(atol=2e-4, rtol=2e-4)
GRAD_TOL = dict(atol=2e-3, rtol=2e-3)
WINDOW = 256


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    title: str
    batch: int = 1
    kv_heads: int = HEADS
    window: bool = False
    docs: str | None = None  # "nine" | "s32"

    def mask(self):
        return dict(causal=True, sliding_window=(WINDOW, 0) if self.window else None)


CASES = {c.name: c for c in (
    Case("causal", "causal"),
    Case("docs9", "causal + 9 docs/row (8 random cuts, none on a shard boundary), batch 2",
         batch=2, docs="nine"),
    Case("docs_s32", "causal + documents of mean length S/32 (random lengths)", docs="s32"),
    Case("gqa", "causal, GQA 4/2 heads", kv_heads=2),
    Case("window", f"causal, sliding window {WINDOW} (token i sees i-{WINDOW}..i)", window=True),
)}


# ----------------------------------------------------------------------------- inputs

def segments(case, seq_len, sp, rng):
    """Natural-order segment ids [batch, S] (1, 2, ...), different cuts in every row."""
    if case.docs is None:
        return None
    shard = seq_len // sp
    rows = []
    for _ in range(case.batch):
        if case.docs == "nine":  # 8 cuts, none on a shard boundary
            allowed = np.array([i for i in range(1, seq_len) if i % shard])
            cuts = rng.choice(allowed, 8, replace=False)
        else:  # 31 uniform random cuts: 32 documents of mean length S/32, random lengths
            cuts = rng.choice(np.arange(1, seq_len), 31, replace=False)
        starts = np.zeros(seq_len, np.int32)
        starts[0] = 1
        starts[cuts] = 1
        rows.append(np.cumsum(starts))
    return np.stack(rows).astype(np.int32)


def make_inputs(case, seq_len, sp, seed):
    rng = np.random.default_rng(seed)
    b, n, kvh = case.batch, HEADS, case.kv_heads
    q = rng.standard_normal((b, seq_len, n, HEAD_DIM), np.float32)
    k = rng.standard_normal((b, seq_len, kvh, HEAD_DIM), np.float32)
    v = rng.standard_normal((b, seq_len, kvh, HEAD_DIM), np.float32)
    dout = rng.standard_normal((b, seq_len, n, HEAD_DIM), np.float32)
    seg = segments(case, seq_len, sp, rng)
    pos = None if seg is None else masks.segment_positions(seg)  # RoPE's, ring_attention's
    return dict(q=q, k=k, v=v, dout=dout, seg=seg, pos=pos)


# ----------------------------------------------------------------------------- oracle

def oracle(case, x):
    """Dense float32 reference (natural order): out, dq, dk, dv as numpy. One (row, query
    head) at a time, so memory is one S x S matrix; dk, dv of a kv head sum over its group."""
    mask = case.mask()

    @jax.jit
    def one(q, k, v, seg, pos, dout):
        f = lambda q, k, v: reference_attention(q, k, v, seg, None, None, positions=pos, **mask)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(dout)

    b, _, n, _ = x["q"].shape
    group = n // case.kv_heads
    out, dq = np.zeros_like(x["q"]), np.zeros_like(x["q"])
    dk, dv = np.zeros_like(x["k"]), np.zeros_like(x["v"])
    for r in range(b):
        for h in range(n):
            kh = h // group
            sl = lambda a, hh: a[r:r + 1, :, hh:hh + 1]  # noqa: E731
            seg = None if x["seg"] is None else x["seg"][r:r + 1]
            pos = None if x["pos"] is None else x["pos"][r:r + 1]
            o, (gq, gk, gv) = one(sl(x["q"], h), sl(x["k"], kh), sl(x["v"], kh), seg, pos,
                                  sl(x["dout"], h))
            out[r, :, h], dq[r, :, h] = np.asarray(o)[0, :, 0], np.asarray(gq)[0, :, 0]
            dk[r, :, kh] += np.asarray(gk)[0, :, 0]
            dv[r, :, kh] += np.asarray(gv)[0, :, 0]
    return out, dq, dk, dv


def row_inputs(case, seq_len, sp):
    """The inputs of a row: the same for every block and every run."""
    return make_inputs(case, seq_len, sp, seed=seq_len + len(case.name))


@functools.lru_cache(maxsize=1)
def row_oracle(case_name, seq_len, sp):
    """oracle() of row_inputs, kept for the next call: bench_ring_blocks.py checks one row at
    several blocks in a row (a minute of its sixteen went to computing it again)."""
    case = CASES[case_name]
    return oracle(case, row_inputs(case, seq_len, sp))


def compare(got, want):
    """Max abs errors and whether every element is within the fixed tolerances."""
    res, ok = {}, True
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        tol = FWD_TOL if name == "out" else GRAD_TOL
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.abs(g - w)
        finite = bool(np.isfinite(g).all())
        within = finite and bool((err <= tol["atol"] + tol["rtol"] * np.abs(w)).all())
        res[f"{name}_max_abs_err"] = float(err.max()) if finite else float("nan")
        ok &= within
    res["passed"] = ok
    return res


def computed_blocks(case, x, seq_len, sp, block, layout, skip_documents):
    """Blocks the ring computes, summed over rows, devices and ring steps (ops/tables.py: the
    host replica of what the ring runs): the work, free of timing noise."""
    spec = masks.make_mask_spec(True, case.mask()["sliding_window"], None)
    if x["seg"] is None or not skip_documents:
        sched = tables.ring_schedule(seq_len, sp, block, layout, **case.mask())
        return int(sched.computed_blocks.sum()) * case.batch
    return int(tables.document_schedule(spec, layout, seq_len, sp, block,
                                        x["seg"]).computed_blocks.sum())


# ----------------------------------------------------------------------------- programs

def _fwd_bwd(attention, n_extra):
    """jit of forward + vjp over q, k, v; `n_extra` non-differentiated inputs after them."""
    def step(q, k, v, *rest):
        extra, dout = rest[:n_extra], rest[n_extra]
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *extra), q, k, v)
        return out, vjp(dout)
    return jax.jit(step)


def longctx_variant(mesh, case, x, seq_len, sp, block, impl, layout, skip_documents,
                    attention=ring_attention):
    """(compiled-able fn, args, back-permutation) for one longctx ring (or `attention`: a
    function with ring_attention's arguments, e.g. another context-parallel strategy)."""
    data = P(None, "sp")
    docs = x["seg"] is not None
    mask = case.mask()

    def per_shard(q, k, v, seg, pos):
        return attention(q, k, v, seg, None, None, positions=pos, axis_name="sp",
                              layout=layout, impl=impl, block_sizes=block,
                              skip_documents=skip_documents, **mask)

    f = jax.shard_map(per_shard, mesh=mesh,
                      in_specs=(data, data, data) + ((data, data) if docs else (None, None)),
                      out_specs=data)
    perm = layout_lib.permutation(layout, seq_len, sp)
    put = lambda a: None if a is None else jax.device_put(a[:, perm], NamedSharding(mesh, data))  # noqa: E731
    args = [put(x[n]) for n in ("q", "k", "v", "seg", "pos", "dout")]
    return _fwd_bwd(f, 2), args, layout_lib.inverse_permutation(perm)


class Unsupported(Exception):
    """The peer cannot express the case (its own API has no such option, or refuses it)."""


def _load_file_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def maxtext_mask(case, seq_len, shards):
    """MaxText's splash mask of a case over `shards` query shards."""
    from maxtext.kernels.tokamax_splash_attention import splash_attention_mask as mask_lib
    if case.window:
        return mask_lib.LocalMask((seq_len, seq_len), window_size=(WINDOW, 0), offset=0,
                                  shard_count=shards)
    return mask_lib.CausalMask((seq_len, seq_len), shard_count=shards)


def maxtext_splash_config(block):
    """MaxText's tokamax splash settings at one block size (kernel in interpret mode off TPU)."""
    from maxtext.kernels.tokamax_splash_attention import splash_attention_kernel as sk
    return sk.SplashConfig(block_q=block, block_kv=block, block_kv_compute=block,
                           block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                           use_fused_bwd_kernel=True, use_base2_exp=False,
                           fuse_reciprocal=True, interpret=jax.default_backend() != "tpu")


def maxtext_variant(mesh, case, x, seq_len, sp, block):
    from maxtext.kernels.tokamax_splash_attention import ring_attention_kernel as rk
    mask, config = maxtext_mask(case, seq_len, sp), maxtext_splash_config(block)
    try:
        kernel = rk.make_ring_attention(mask, config=config, is_mqa=False, ring_axis="sp",
                                        q_seq_shards=sp, kv_seq_shards=sp)
    except NotImplementedError as e:
        raise Unsupported(cli.one_line(e)) from e
    kspec = kernel.manual_sharding_spec()
    data = P(None, "sp")
    docs = x["seg"] is not None

    def per_shard(kernel, q, k, v, seg):
        heads_major = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [b, L, n, h] -> [b, n, L, h]
        # Splash kernels take q already scaled (MaxText scales it before the call).
        q, k, v = map(heads_major, (q * HEAD_DIM ** -0.5, k, v))
        if seg is None:
            out = jax.vmap(lambda q, k, v: kernel(q, k, v, None, None, None))(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, rk.SegmentIds(s, s), None, None))(
                q, k, v, seg)
        return heads_major(out)

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(kspec, data, data, data, data if docs else None),
                      out_specs=data, check_vma=False)
    attention = lambda q, k, v, kern, seg: f(kern, q, k, v, seg)  # noqa: E731
    put = lambda a: None if a is None else jax.device_put(a, NamedSharding(mesh, data))  # noqa: E731
    kern = jax.tree.map(lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s)),
                        kernel, kspec, is_leaf=lambda a: a is None)
    args = [put(x["q"]), put(x["k"]), put(x["v"]), kern, put(x["seg"]), put(x["dout"])]
    return _fwd_bwd(attention, 2), args, None


class _Kwargs(dict):
    """ringattention takes its blockwise options as a dict in a nondiff (static) argument."""
    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


def ringattention_variant(mesh, case, x, seq_len, sp, block, peers_dir):
    if case.window:
        raise Unsupported("no sliding-window option")
    # By file: the package's __init__ probes jax.lib.xla_bridge and imports its Pallas variants.
    ra = _load_file_module("peer_ringattention_jax",
                           os.path.join(peers_dir, "ringattention", "ringattention_jax.py"))
    kwargs = _Kwargs(causal_block_size=1, query_chunk_size=block, key_chunk_size=block,
                     deterministic=True, dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32,
                     policy=jax.checkpoint_policies.nothing_saveable, precision=None,
                     prevent_cse=True)
    data = P(None, "sp")
    docs = x["seg"] is not None

    def per_shard(q, k, v, seg):
        return ra.ring_attention(q, k, v, None, seg, None, "sp", True, kwargs)

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(data, data, data, P() if docs else None),
                      out_specs=data, check_vma=False)
    put = lambda a, s=data: None if a is None else jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = [put(x["q"]), put(x["k"]), put(x["v"]), put(x["seg"], P()), put(x["dout"])]
    return _fwd_bwd(f, 1), args, None


# ----------------------------------------------------------------------------- one (case, S)

def variant_list(args, case):
    out = []
    if args.peers:
        out += [(p, dict(peer=p)) for p in PEERS]
    for skip in ((True, False) if case.docs else (True,)):
        for impl in args.impls:
            for layout in args.layouts:
                name = f"{impl}/{layout}" + ("" if skip else "/noskip")
                out.append((name, dict(impl=impl, layout=layout, skip_documents=skip)))
    return out


def layout_block(block, shard, layout):
    """The block of a longctx variant: `block`, halved until it divides the pieces of the shard
    that hold consecutive positions, L/2 for zigzag and a stripe for striped (the rule of
    masks.default_block_size)."""
    piece = layout_lib.piece_length(layout, shard)
    while piece % block and block % 2 == 0:
        block //= 2
    return block


def compile_and_check(name, rec, build, want):
    """Compiles build()'s (fn, args, back-permutation), runs it once and checks the output and
    gradients against `want` (the oracle's, or None); fills rec (compile_s, first_run_s, check,
    status). Returns (compiled, args) to time, or None when the variant rejects the case or
    fails (a result, recorded in rec["status"])."""
    try:
        fn, fargs, back = build()
        t0 = time.perf_counter()
        compiled = fn.lower(*fargs).compile()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        out, grads = jax.block_until_ready(compiled(*fargs))
        rec["first_run_s"] = round(time.perf_counter() - t0, 3)
    except Unsupported as e:
        rec["status"] = f"rejects: {e}"
        print(f"   {name:28s} rejects: {e}", flush=True)
        return None
    except Exception as e:  # noqa: BLE001  (a peer or variant that fails is a result)
        rec["status"] = f"fails: {type(e).__name__}: {cli.one_line(e)[:300]}"
        print(f"   {name:28s} {rec['status']}", flush=True)
        return None
    if want is not None:
        got = [np.asarray(a) for a in (out, *grads)]
        if back is not None:
            got = [a[:, back] for a in got]
        rec["check"] = compare(got, want)
    del out, grads
    rec["status"] = "ok" if want is None or rec["check"]["passed"] else "WRONG"
    chk = rec.get("check")
    print(f"   {name:28s} compile {rec['compile_s']:6.1f}s first {rec['first_run_s'] * 1e3:8.0f} ms"
          + ("" if chk is None else
             f"  err out {chk['out_max_abs_err']:.1e} dq {chk['dq_max_abs_err']:.1e}"
             f" dk {chk['dk_max_abs_err']:.1e} dv {chk['dv_max_abs_err']:.1e}"
             f" {'ok' if chk['passed'] else 'WRONG'}"), flush=True)
    return compiled, fargs


def time_round_robin(variants, runnable, repeats):
    """Times each {name: (compiled, args)} `repeats` times, one run of each in turn, so that
    machine noise hits all alike; adds times_s, cpu_times_s and their medians to variants[name]."""
    for name in runnable:
        variants[name]["times_s"] = []
        variants[name]["cpu_times_s"] = []
    for _ in range(repeats):
        for name, (compiled, fargs) in runnable.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled(*fargs))
            variants[name]["times_s"].append(time.perf_counter() - t0)
            variants[name]["cpu_times_s"].append(time.process_time() - c0)
    for name in runnable:
        rec = variants[name]
        rec["median_s"] = float(np.median(rec["times_s"]))
        rec["median_cpu_s"] = float(np.median(rec["cpu_times_s"]))
        print(f"   {name:28s} median {rec['median_s'] * 1e3:8.0f} ms  "
              f"({', '.join(f'{t * 1e3:.0f}' for t in rec['times_s'])})", flush=True)


def start_row(case, seq_len, sp, block, check_up_to):
    """(row record, inputs, the oracle's out and grads or None above check_up_to) of a (case, S)."""
    x = row_inputs(case, seq_len, sp)
    row = {"case": case.name, "title": case.title, "seq_len": seq_len, "sp": sp,
           "batch": case.batch, "heads": HEADS, "kv_heads": case.kv_heads, "head_dim": HEAD_DIM,
           "block": block, "mask": {k: v for k, v in case.mask().items() if v is not None},
           "documents_per_row": None if x["seg"] is None else [int(s.max()) for s in x["seg"]],
           "checked": seq_len <= check_up_to, "variants": {}}
    print(f"== {case.name} S={seq_len} (batch {case.batch}, block {block})", flush=True)
    want = None
    if row["checked"]:
        t0 = time.perf_counter()
        want = row_oracle(case.name, seq_len, sp)
        row["oracle_s"] = round(time.perf_counter() - t0, 2)
        print(f"   oracle {row['oracle_s']:.1f}s", flush=True)
    return row, x, want


def run_row(args, mesh, case, seq_len):
    sp = args.sp
    shard = seq_len // sp
    block = min(args.block, shard)
    row, x, want = start_row(case, seq_len, sp, block, args.check_up_to)
    runnable = {}
    for name, spec in variant_list(args, case):
        rec = dict(spec)
        row["variants"][name] = rec

        def build(spec=spec, rec=rec):
            if "peer" in spec:
                if spec["peer"] == "maxtext":
                    return maxtext_variant(mesh, case, x, seq_len, sp, block)
                return ringattention_variant(mesh, case, x, seq_len, sp, block, args.peers)
            rec["block"] = layout_block(block, shard, spec["layout"])
            rec["computed_blocks"] = computed_blocks(case, x, seq_len, sp, rec["block"],
                                                     spec["layout"], spec["skip_documents"])
            return longctx_variant(mesh, case, x, seq_len, sp, rec["block"], **spec)

        compiled = compile_and_check(name, rec, build, want)
        if compiled is not None:
            runnable[name] = compiled
    time_round_robin(row["variants"], runnable, args.repeats)
    return row


# ----------------------------------------------------------------------------- main

def impls_and_layouts(ap, args):
    """--impls and --layouts made checked tuples in `args`."""
    args.impls = tuple(i for i in args.impls.split(",") if i)
    args.layouts = tuple(x for x in args.layouts.split(",") if x)
    if not set(args.impls) <= set(IMPLS) or not set(args.layouts) <= set(LAYOUTS):
        ap.error(f"--impls from {IMPLS}, --layouts from {LAYOUTS}")


def selection(ap, args):
    """The cases of --cases (checked); --impls and --layouts as impls_and_layouts makes them."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    impls_and_layouts(ap, args)
    return cases


def quick_defaults(args, seq_lens: str) -> None:
    """--quick: `seq_lens` and one run unless the command line says otherwise, and no peers."""
    explicit = set(a.split("=")[0] for a in sys.argv[1:])
    if args.quick:
        if "--seq-lens" not in explicit:
            args.seq_lens = seq_lens
        if "--repeats" not in explicit:
            args.repeats = 1
        args.peers = None


def use_peers(args, packages: str) -> None:
    """--peers DIR made absolute, checked to hold maxtext, and importable by this script only
    (longctx never imports peer code); `packages` is the pip install the message suggests."""
    if not args.peers:
        return
    args.peers = os.path.abspath(args.peers)
    if not os.path.isdir(os.path.join(args.peers, "maxtext")):
        raise MissingFileError(f"--peers {args.peers}: no maxtext package there (pip install "
                               f"--no-deps --target {args.peers} {packages}).")
    sys.path.insert(0, args.peers)


def sp_mesh(ap, sp):
    """bench_common.sp_mesh, after checking that --sp has its devices."""
    if jax.device_count() < sp:
        ap.error(f"--sp {sp} needs {sp} devices, have {jax.device_count()}")
    return bc.sp_mesh(sp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S=2048 only, one run, no peers")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--seq-lens", default="2048,8192")
    # 5, not 3: this machine's noise comes in bursts that slow a whole round by 20-30%; with 3
    # rounds two slow ones set the median, as they did for several variants of one run here.
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--check-up-to", type=int, default=8192,
                    help="largest S checked against the dense oracle")
    ap.add_argument("--peers", default=None,
                    help="directory with maxtext and ringattention (pip install --target)")
    bc.add_output_arguments(ap, "bench_ring", "rewrite the markdown section from --json without running")
    args = ap.parse_args()
    if args.render_only:
        cli.validated(f"--render-only from {args.json}")
        result = json.load(open(args.json))
        result["targets"] = report.targets(result) + [report.check_line(result)]
        bc.write_json(args.json, result)
        bc.write_section("bench_ring", report.markdown(result), args.md)
        print(report.markdown(result))
        return 0
    quick_defaults(args, "2048")
    cases = selection(ap, args)
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    use_peers(args, "maxtext ringattention")
    mesh = sp_mesh(ap, args.sp)
    cli.validated(f"the flags are fine ({len(cases)} case(s) on sp={args.sp})")
    result = {"command": bc.command_line(), "machine": bc.machine(),
              "settings": {"cases": cases, "heads": HEADS, "head_dim": HEAD_DIM, "window": WINDOW,
                           "sp": args.sp, "block": args.block, "repeats": args.repeats,
                           "check_up_to": args.check_up_to, "impls": list(args.impls),
                           "layouts": list(args.layouts), "peers": bool(args.peers),
                           "fwd_tol": FWD_TOL, "grad_tol": GRAD_TOL},
              "rows": [], "targets": []}
    start = time.perf_counter()
    result["load_avg"] = {"start": os.getloadavg()[0]}
    for seq_len in seq_lens:
        for name in cases:
            result["rows"].append(run_row(args, mesh, CASES[name], seq_len))
            result["targets"] = report.targets(result) + [report.check_line(result)]
            bc.write_json(args.json, result)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["load_avg"]["end"] = os.getloadavg()[0]
    result["targets"] = report.targets(result) + [report.check_line(result)]
    bc.write_json(args.json, result)
    bc.write_section("bench_ring", report.markdown(result), args.md)
    for t in result["targets"]:
        print(t)
    return 0


if __name__ == "__main__":
    cli.run(main)
