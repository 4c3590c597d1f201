"""Every context-parallel strategy on bench_ring.py's inputs: fwd+bwd time of ring, all_gather,
ulysses and usp (U = 2) x impl (splash, xla), with and without document skipping, every result
checked against the dense oracle, and the bytes each device sends, read from the lowered program
and from the closed form (longctx/plan/collectives.py); optionally beside MaxText's kernels.

  .venv/bin/python benchmarks/bench_cp.py --peers /tmp/peers    # the table: S = 8192, with peers
  .venv/bin/python benchmarks/bench_cp.py --impls xla            # the xla backend only
  .venv/bin/python benchmarks/bench_cp.py --quick                # S = 1024, one run, no peers
  .venv/bin/python benchmarks/bench_cp.py --render-only          # rewrite the markdown from the JSON

Cases: bench_ring.py's (causal, docs9 batch 2, docs_s32, gqa 4/2, window 256; 4 heads x 64,
float32, sp = 4), one layout for every strategy (--layout, zigzag: Ulysses needs no balance, the
others take the ring's), block --block (512) but --docs-block (256) for docs_s32: the target is
every strategy at least 3x faster with skipping on than off for documents of mean length S/32 at
S = 8192 and block 256 (a target line per strategy and impl).

Peers (--peers DIR, a `pip install --no-deps --target` directory with maxtext==0.2.5):
  maxtext_ring        bench_ring.py's maxtext peer (the tokamax splash ring)
  maxtext_all_gather  MaxText's all-gather path: its tokamax splash kernel with the mask split by
                      query shard (q_seq_shards = sp), K/V and their segment ids replicated by the
                      shard_map's in_specs (XLA gathers them; the cotangents are reduced back)
  maxtext_ulysses     MaxText's Ulysses path rebuilt from its pieces: its all-to-all ([B, H, S/U, D]
                      -> [B, H/U, S, D], split 1, concat 2) and its single-device tokamax splash
                      kernel over the whole sequence, segment ids all-gathered
  maxtext_usp         its USP path rebuilt likewise on a (ring 2, ulysses 2) mesh of the same
                      devices: the all-to-all over ulysses, its tokamax ring over the ring axis
maxtext.kernels.attention.ulysses_attention and usp_attention do not import with jax alone
(they need omegaconf and pathwaysutils), hence "rebuilt": the collectives and kernels are
MaxText's, the glue is the few lines of attention_op.py that call them. Their own checks are
applied: Ulysses and USP take global causal attention only (no window) and KV heads divisible by
the Ulysses size. A peer that cannot express a case, or fails, is recorded as such.

Communication: per (case, strategy), the lowered program of one attention call (impl xla, the
same collectives as splash), forward and backward, with skip_documents=False (the static
schedule: the ring with documents may stop early, a loop count no program text can tell, so this
is its most), beside the closed form; per peer, its whole fwd+bwd program's HLO. And the
communication table: bytes per device per layer for Llama-3-8B attention (32 heads, 8 KV, head_dim 128, bf16)
at 131,072 tokens on sp = 16, by formula and, with libtpu, from the TPU lowering of one attention
fwd+bwd (Mosaic kernels) on the abstract v5p:2x2x4 topology (lowered, not compiled: seconds).
CPU timings do not show interconnect costs: here the sp devices share one host's memory.
Writes docs/bench_cp.json and the bench_cp section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_common as bc  # noqa: E402
import bench_ring as br  # noqa: E402
from longctx.ops import context_parallel  # noqa: E402
from longctx.plan import aot, collectives  # noqa: E402

STRATEGIES = {"ring": None, "all_gather": None, "ulysses": None, "usp": 2}  # name: Ulysses degree
PEERS = ("maxtext_ring", "maxtext_all_gather", "maxtext_ulysses", "maxtext_usp")
MIB = 2 ** 20
# The communication table: Llama-3-8B attention, 131,072 tokens, sp = 16.
LLAMA3_8B = collectives.Shape(batch=1, seq_len=131072, sp=16, heads=32, kv_heads=8, head_dim=128,
                              dtype_bytes=2)
TABLE_STRATEGIES = (("ring", None), ("all_gather", None), ("ulysses", None), ("usp", 2),
                    ("usp", 4), ("usp", 8))
TPU_TOPOLOGY = "v5p:2x2x4"


# ----------------------------------------------------------------------------- peers

def _heads_major(a):
    return jnp.swapaxes(a, 1, 2)  # [b, L, n, h] <-> [b, n, L, h]


def _maxtext_ulysses_checks(case, size):
    """MaxText's own refusals (attention_op.py, ulysses_attention.validate_head_sharding)."""
    if case.window:
        raise br.Unsupported("MaxText's Ulysses/USP take global causal attention only (no window)")
    if case.kv_heads % size:
        raise br.Unsupported(f"MaxText's Ulysses needs the KV heads ({case.kv_heads}) divisible by "
                             f"the Ulysses size ({size})")


def _all_to_all(x, axis):
    """maxtext ulysses_attention.ulysses_all_to_all: [B, H, S/U, D] -> [B, H/U, S, D]."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def _inverse_all_to_all(x, axis):
    return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _call_splash(kernel, sk, q, k, v, q_seg, kv_seg):
    if q_seg is None:
        return jax.vmap(lambda q, k, v: kernel(q, k, v, None, None))(q, k, v)
    return jax.vmap(lambda q, k, v, a, b: kernel(q, k, v, sk.SegmentIds(a, b), None))(
        q, k, v, q_seg, kv_seg)


def _put(mesh, a, spec):
    return None if a is None else jax.device_put(a, NamedSharding(mesh, spec))


def maxtext_all_gather_variant(mesh, case, x, seq_len, sp, block):
    from maxtext.kernels.tokamax_splash_attention import splash_attention_kernel as sk
    kernel = sk.make_splash_mha(br.maxtext_mask(case, seq_len, sp),
                                config=br.maxtext_splash_config(block), q_seq_shards=sp)
    kspec = kernel.manual_sharding_spec(NamedSharding(mesh, P("sp")))
    data, whole = P(None, "sp"), P()
    docs = x["seg"] is not None

    def per_shard(kernel, q, k, v, q_seg, kv_seg):
        q, k, v = map(_heads_major, (q * br.HEAD_DIM ** -0.5, k, v))
        return _heads_major(_call_splash(kernel, sk, q, k, v, q_seg, kv_seg))

    f = jax.shard_map(per_shard, mesh=mesh,
                      in_specs=(kspec, data, whole, whole) + ((data, whole) if docs else (None, None)),
                      out_specs=data, check_vma=False)
    kern = jax.tree.map(lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s)),
                        kernel, kspec, is_leaf=lambda a: a is None)
    attention = lambda q, k, v, kern, qs, ks: f(kern, q, k, v, qs, ks)  # noqa: E731
    args = [_put(mesh, x["q"], data), _put(mesh, x["k"], whole), _put(mesh, x["v"], whole), kern,
            _put(mesh, x["seg"], data), _put(mesh, x["seg"], whole), _put(mesh, x["dout"], data)]
    return br._fwd_bwd(attention, 3), args, None


def maxtext_ulysses_variant(mesh, case, x, seq_len, sp, block):
    from maxtext.kernels.tokamax_splash_attention import splash_attention_kernel as sk
    _maxtext_ulysses_checks(case, sp)
    kernel = sk.make_splash_mha(br.maxtext_mask(case, seq_len, 1),
                                config=br.maxtext_splash_config(block), q_seq_shards=1)
    data = P(None, "sp")
    docs = x["seg"] is not None

    def per_shard(q, k, v, seg):
        q, k, v = (_all_to_all(_heads_major(a), "sp") for a in (q * br.HEAD_DIM ** -0.5, k, v))
        whole = None if seg is None else lax.all_gather(seg, "sp", axis=1, tiled=True)
        return _heads_major(_inverse_all_to_all(_call_splash(kernel, sk, q, k, v, whole, whole), "sp"))

    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(data, data, data, data if docs else None),
                      out_specs=data, check_vma=False)
    args = [_put(mesh, x[n], data) for n in ("q", "k", "v", "seg", "dout")]
    return br._fwd_bwd(f, 1), args, None


def maxtext_usp_variant(mesh, case, x, seq_len, sp, block, degree):
    from maxtext.kernels.tokamax_splash_attention import ring_attention_kernel as rk
    _maxtext_ulysses_checks(case, degree)
    rings = sp // degree
    usp_mesh = jax.make_mesh((rings, degree), ("ring", "uly"), devices=mesh.devices.reshape(-1),
                             axis_types=(AxisType.Auto,) * 2)
    try:
        kernel = rk.make_ring_attention(br.maxtext_mask(case, seq_len, rings),
                                        config=br.maxtext_splash_config(block), is_mqa=False,
                                        ring_axis="ring", q_seq_shards=rings, kv_seq_shards=rings)
    except NotImplementedError as e:
        raise br.Unsupported(cli.one_line(e)) from e
    kspec = kernel.manual_sharding_spec()
    data = P(None, ("ring", "uly"))  # MaxText's USP sequence sharding: ring outer, Ulysses inner
    docs = x["seg"] is not None

    def per_shard(kernel, q, k, v, seg):
        q, k, v = (_all_to_all(_heads_major(a), "uly") for a in (q * br.HEAD_DIM ** -0.5, k, v))
        ring_seg = None if seg is None else lax.all_gather(seg, "uly", axis=1, tiled=True)
        if ring_seg is None:
            out = jax.vmap(lambda q, k, v: kernel(q, k, v, None, None, None))(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, rk.SegmentIds(s, s), None, None))(
                q, k, v, ring_seg)
        return _heads_major(_inverse_all_to_all(out, "uly"))

    f = jax.shard_map(per_shard, mesh=usp_mesh, in_specs=(kspec, data, data, data, data if docs else None),
                      out_specs=data, check_vma=False)
    kern = jax.tree.map(lambda a, s: None if a is None else jax.device_put(a, NamedSharding(usp_mesh, s)),
                        kernel, kspec, is_leaf=lambda a: a is None)
    attention = lambda q, k, v, kern, seg: f(kern, q, k, v, seg)  # noqa: E731
    args = [_put(usp_mesh, x["q"], data), _put(usp_mesh, x["k"], data), _put(usp_mesh, x["v"], data),
            kern, _put(usp_mesh, x["seg"], data), _put(usp_mesh, x["dout"], data)]
    return br._fwd_bwd(attention, 2), args, None


def peer_variant(peer, mesh, case, x, seq_len, sp, block):
    if peer == "maxtext_ring":
        return br.maxtext_variant(mesh, case, x, seq_len, sp, block)
    if peer == "maxtext_all_gather":
        return maxtext_all_gather_variant(mesh, case, x, seq_len, sp, block)
    if peer == "maxtext_ulysses":
        return maxtext_ulysses_variant(mesh, case, x, seq_len, sp, block)
    return maxtext_usp_variant(mesh, case, x, seq_len, sp, block, STRATEGIES["usp"])


# ----------------------------------------------------------------------------- communication

def _mib(traffic_or_bytes):
    n = traffic_or_bytes if isinstance(traffic_or_bytes, int) else traffic_or_bytes.total_sent
    return round(n / MIB, 3)


def communication(mesh, case, seq_len, sp, block, layout):
    """{strategy: bytes one device sends per call, forward/backward, HLO and formula}."""
    shape = collectives.Shape(batch=case.batch, seq_len=seq_len, sp=sp, heads=br.HEADS,
                              kv_heads=case.kv_heads, head_dim=br.HEAD_DIM, dtype_bytes=4,
                              documents=case.docs is not None)
    mask = case.mask()
    out = {}
    for strategy, degree in STRATEGIES.items():
        got = collectives.attention_traffic(mesh, shape, strategy, degree, impl="xla", layout=layout,
                                            block_sizes=block, skip_documents=False, **mask)
        want = collectives.formula(strategy, shape, degree=degree, layout=layout, block=block, **mask)
        out[strategy] = {"hlo": {p: got[p].as_dict() for p in got}, "formula_bytes": want,
                         "unknown_loops": sum(t.unknown_loops for t in got.values())}
    return out


def llama3_8b_table(tpu: bool) -> dict:
    """The communication table: bytes per device per layer (one attention call), 8B shape, by formula
    and, when libtpu is here, from the TPU lowering (splash, layout auto, causal)."""
    shape, rows = LLAMA3_8B, []
    mesh = None
    if tpu:
        devices = aot.topology_devices(TPU_TOPOLOGY)
        mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, shape.sp), ("dp", "fsdp", "sp"),
                                 axis_types=(AxisType.Auto,) * 3)
    for strategy, degree in TABLE_STRATEGIES:
        row = {"strategy": strategy, "degree": degree,
               "formula_bytes": collectives.formula(strategy, shape, degree=degree)}
        if mesh is not None:
            t0 = time.perf_counter()
            got = collectives.attention_traffic(mesh, shape, strategy, degree, impl="splash",
                                                layout="auto", causal=True, block_sizes=512)
            row["tpu_lowering"] = {p: got[p].as_dict() for p in got}
            row["lower_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"   8B comm {strategy}{'' if degree is None else f' U={degree}'}: formula "
              f"{row['formula_bytes']}" + (f", TPU lowering {[got[p].total_sent for p in got]}"
                                            if mesh is not None else ""), flush=True)
    return {"shape": vars(shape) if hasattr(shape, "__dict__") else shape.__dict__,
            "topology": TPU_TOPOLOGY if tpu else None, "rows": rows}


# ----------------------------------------------------------------------------- one (case, S)

def case_block(args, case):
    return args.docs_block if case.name == "docs_s32" else args.block


def variant_list(args, case):
    out = [(p, dict(peer=p)) for p in PEERS] if args.peers else []
    for skip in ((True, False) if case.docs else (True,)):
        for strategy in STRATEGIES:
            for impl in args.impls:
                out.append((f"{strategy}/{impl}" + ("" if skip else "/noskip"),
                            dict(strategy=strategy, impl=impl, skip_documents=skip)))
    return out


def run_row(args, mesh, case, seq_len):
    sp, layout = args.sp, args.layout
    shard = seq_len // sp
    block = br.layout_block(min(case_block(args, case), shard), shard, layout)
    row, x, want = br.start_row(case, seq_len, sp, block, args.check_up_to)
    row["layout"] = layout
    row["communication"] = communication(mesh, case, seq_len, sp, block, layout)
    runnable = {}
    for name, spec in variant_list(args, case):
        rec = dict(spec)
        row["variants"][name] = rec

        def build(spec=spec, rec=rec):
            if "peer" in spec:
                return peer_variant(spec["peer"], mesh, case, x, seq_len, sp, block)
            rec["block"] = block
            rec["computed_blocks"] = br.computed_blocks(case, x, seq_len, sp, block, layout,
                                                        spec["skip_documents"])
            attention = functools.partial(context_parallel.context_parallel_attention,
                                          strategy=spec["strategy"],
                                          ulysses_degree=STRATEGIES[spec["strategy"]])
            return br.longctx_variant(mesh, case, x, seq_len, sp, block, spec["impl"], layout,
                                      spec["skip_documents"], attention=attention)

        compiled = br.compile_and_check(name, rec, build, want)
        if compiled is not None:
            runnable[name] = compiled
            if "peer" in spec:  # the peer's own collectives, forward + backward together
                rec["hlo_fwd_bwd"] = collectives.hlo_traffic(compiled[0].as_text()).as_dict()
    br.time_round_robin(row["variants"], runnable, args.repeats)
    return row


# ----------------------------------------------------------------------------- report

def _good(rec, key="median_s"):
    return rec is not None and key in rec and rec.get("status") == "ok"


def targets(result, key="median_s"):
    """One line per strategy x impl: the target, >= 3x with skipping at docs_s32, S = 8192, block 256."""
    lines = []
    rows = [r for r in result["rows"] if r["case"] == "docs_s32"]
    for row in rows:
        where = f"docs_s32 S={row['seq_len']:,} block {row['block']}"
        official = row["seq_len"] == 8192 and row["block"] == 256
        for strategy in STRATEGIES:
            for impl in result["settings"]["impls"]:
                on = row["variants"].get(f"{strategy}/{impl}")
                off = row["variants"].get(f"{strategy}/{impl}/noskip")
                if not (_good(on, key) and _good(off, key)):
                    lines.append(f"{where}: {strategy} {impl}: not measured (or wrong)")
                    continue
                x = off[key] / on[key]
                verdict = ("met" if x >= 3 else "NOT met") if official else "not the target's S/block"
                lines.append(f"{where}: {strategy} {impl} skipping on is {x:.2f}x faster than off "
                             f"({on[key] * 1e3:,.0f} vs {off[key] * 1e3:,.0f} ms; blocks "
                             f"{off.get('computed_blocks', '-')}/{on.get('computed_blocks', '-')}); "
                             f"target >= 3x: {verdict}")
    return lines


def check_line(result):
    recs = [v for r in result["rows"] if r["checked"] for v in r["variants"].values() if "check" in v]
    bad = sum(not v["check"]["passed"] for v in recs)
    return (f"oracle check: {len(recs) - bad} of {len(recs)} checked variants within the fixed "
            f"tolerances (out {br.FWD_TOL}, grads {br.GRAD_TOL})")


def _comm_cell(comm, strategy):
    c = comm[strategy]
    hlo = [c["hlo"][p]["sent_bytes"] / MIB for p in ("forward", "backward")]
    formula = [c["formula_bytes"][p] / MIB for p in ("forward", "backward")]
    same = "=" if [round(h, 6) for h in hlo] == [round(f, 6) for f in formula] else "vs formula " + \
        " / ".join(f"{f:.2f}" for f in formula)
    return f"{hlo[0]:.2f} / {hlo[1]:.2f} ({same})"


def _peer_comm(rec):
    h = rec.get("hlo_fwd_bwd")
    return "-" if h is None else f"{h['sent_bytes'] / MIB:.2f} (fwd+bwd)"


def markdown(result, key="median_s"):
    st, m = result["settings"], result["machine"]
    table = []
    for row in result["rows"]:
        v = row["variants"]
        where = f"{row['case']} (S {row['seq_len']:,}, block {row['block']})"
        for name, rec in v.items():
            if name.endswith("/noskip"):
                continue
            off = v.get(name + "/noskip")
            if "peer" in rec:
                table.append([where, name, br.report.cell(rec, key), "-", "-", _peer_comm(rec)])
                continue
            speed = ("-" if off is None else
                     f"{br.report.cell(off, key)} ({off[key] / rec[key]:.2f}x)"
                     if _good(off, key) and _good(rec, key) else br.report.cell(off, key))
            blocks = f"{rec.get('computed_blocks', '-')}" + (
                "" if off is None else f" / {off.get('computed_blocks', '-')}")
            table.append([where, name, br.report.cell(rec, key), speed, blocks,
                          _comm_cell(row["communication"], rec["strategy"])])
    heads = ["case", "variant", "ms (skip on)", "ms skip_documents=False (speedup)",
             "blocks on / off", "MiB sent per device fwd / bwd (HLO; formula)"]
    out = [
        "## Context-parallel strategies (`bench_cp.py`)\n",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPU cores ({m.get('cpu_model', '')}, shared), jax {m['jax']}, "
        f"{m['date_utc']} UTC" + (f", {result['wall_s'] / 60:.0f} min" if "wall_s" in result else "")
        + f". bench_ring.py's cases at S = {', '.join(f'{s:,}' for s in st['seq_lens'])}, "
        f"sp = {st['sp']}, {br.HEADS} heads x {br.HEAD_DIM}, float32, fwd+bwd, layout {st['layout']}, "
        f"block {st['block']} (docs_s32: {st['docs_block']}), median of {st['repeats']} (round-robin); "
        f"every variant checked against the dense oracle (S <= {st['check_up_to']:,}). usp has "
        f"U = {STRATEGIES['usp']}.\n",
        "**CPU timings do not show interconnect costs**: the sp devices here are one host's "
        "threads and a collective is a memory copy, so a strategy that moves more bytes is not "
        "slower here as it would be over ICI. The bytes each device sends (= receives) per call "
        "stand beside the times: read from the lowered program's collectives "
        "(longctx/plan/collectives.py; skip_documents=False, the static schedule: the ring with "
        "documents may stop earlier) and checked against the closed form ('=' where equal).\n",
        bc.table(heads, table),
        "\n### Targets\n",
    ]
    out += [f"- {line}" for line in result.get("targets", [])]
    out.append(f"- {check_line(result)}")
    peers = [(n, r) for row in result["rows"] for n, r in row["variants"].items() if "peer" in r
             and r.get("status", "").startswith(("rejects", "fails"))]
    if peers or not st.get("peers"):
        out.append("\n### Peers that do not run a case\n")
        if not st.get("peers"):
            out.append("- no peers in this run (--peers not given)")
        seen = set()
        for n, r in peers:
            if (n, r["status"]) not in seen:
                seen.add((n, r["status"]))
                out.append(f"- {n}: {r['status']}")
        out.append("- maxtext.kernels.attention.ulysses_attention / usp_attention do not import with "
                   "jax alone (omegaconf, pathwaysutils): maxtext_ulysses and maxtext_usp are rebuilt "
                   "from MaxText's kernels and all-to-all (see the script's docstring)")
    out += ["", comm_markdown(result["llama3_8b"])]
    return "\n".join(out) + "\n"


def comm_markdown(t):
    s = t["shape"]
    lowered = t["topology"] is not None
    heads = ["strategy", "forward MiB (formula)", "backward MiB (formula)"] + (
        [f"forward MiB ({t['topology']} lowering)", "backward MiB (lowering)", "by kind (fwd+bwd, lowering)"]
        if lowered else [])
    rows = []
    for r in t["rows"]:
        name = r["strategy"] + ("" if r["degree"] is None else f" U={r['degree']}")
        cells = [name] + [f"{r['formula_bytes'][p] / MIB:,.1f}" for p in ("forward", "backward")]
        if lowered:
            lo = r["tpu_lowering"]
            kinds = {}
            for p in ("forward", "backward"):
                for k, v in lo[p]["sent_by_kind"].items():
                    kinds[k] = kinds.get(k, 0) + v
            cells += [f"{lo[p]['sent_bytes'] / MIB:,.1f}" for p in ("forward", "backward")]
            cells.append(", ".join(f"{k} {v / MIB:,.0f}" for k, v in kinds.items()))
        rows.append(cells)
    return "\n".join([
        "### Communication per device per layer: Llama-3-8B attention at 131,072 tokens, sp = 16\n",
        f"{s['heads']} heads, {s['kv_heads']} KV heads, head_dim {s['head_dim']}, bf16, batch "
        f"{s['batch']}, causal, no documents (with documents each K/V shard carries "
        f"{4 * s['seq_len'] // s['sp'] // 1024} KiB of int32 ids more). Bytes one device sends "
        "(= receives) in one attention call; MiB = 2^20 bytes. Formula: "
        "longctx.plan.collectives.formula; lowering: the collectives of the TPU program of one "
        "attention fwd+bwd (splash, Mosaic kernels, layout auto) lowered for the abstract topology "
        "(not compiled). Ulysses over 16 devices has 8 KV heads: each is sent to the 2 devices whose "
        "query heads read it.\n",
        bc.table(heads, rows)])


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="S=1024 only, one run, no peers")
    ap.add_argument("--cases", default=",".join(br.CASES))
    ap.add_argument("--seq-lens", default="8192")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    ap.add_argument("--impls", default=",".join(br.IMPLS))
    ap.add_argument("--layout", default="zigzag", choices=br.LAYOUTS)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--docs-block", type=int, default=256, help="the block of docs_s32")
    ap.add_argument("--check-up-to", type=int, default=8192,
                    help="largest S checked against the dense oracle")
    ap.add_argument("--peers", default=None, help="directory with maxtext (pip install --target)")
    ap.add_argument("--no-tpu", action="store_true",
                    help="the 8B communication table by formula only (no TPU lowering)")
    bc.add_output_arguments(ap, "bench_cp", "rewrite the markdown section from --json without running")
    args = ap.parse_args()
    if args.render_only:
        cli.validated(f"--render-only from {args.json}")
        result = json.load(open(args.json))
        result["targets"] = targets(result)
        bc.write_json(args.json, result)
        bc.write_section("bench_cp", markdown(result), args.md)
        print(markdown(result))
        return 0
    br.quick_defaults(args, "1024")
    args.layouts = args.layout
    cases = br.selection(ap, args)
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    br.use_peers(args, "maxtext==0.2.5")
    mesh = br.sp_mesh(ap, args.sp)
    cli.validated(f"the flags are fine ({len(cases)} case(s) on sp={args.sp})")
    tpu = not args.no_tpu and aot.libtpu_available()
    result = {"command": bc.command_line(), "machine": bc.machine(),
              "settings": {"cases": cases, "seq_lens": seq_lens, "heads": br.HEADS,
                           "head_dim": br.HEAD_DIM, "window": br.WINDOW, "sp": args.sp,
                           "layout": args.layout, "block": args.block, "docs_block": args.docs_block,
                           "repeats": args.repeats, "check_up_to": args.check_up_to,
                           "impls": list(args.impls), "strategies": STRATEGIES,
                           "peers": bool(args.peers), "fwd_tol": br.FWD_TOL, "grad_tol": br.GRAD_TOL},
              "llama3_8b": llama3_8b_table(tpu), "rows": [], "targets": []}
    start = time.perf_counter()
    result["load_avg"] = {"start": os.getloadavg()[0]}
    for seq_len in seq_lens:
        for name in cases:
            result["rows"].append(run_row(args, mesh, br.CASES[name], seq_len))
            result["targets"] = targets(result)
            bc.write_json(args.json, result)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["load_avg"]["end"] = os.getloadavg()[0]
    result["targets"] = targets(result)
    bc.write_json(args.json, result)
    bc.write_section("bench_cp", markdown(result), args.md)
    for t in result["targets"] + [check_line(result)]:
        print(t)
    return 0


if __name__ == "__main__":
    cli.run(main)
