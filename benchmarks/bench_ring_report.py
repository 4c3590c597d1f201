"""The report of benchmarks/bench_ring.py from its JSON alone: the markdown tables (wall and
process CPU time), the ratios of each row, and one line per target (targets()).

Row ratios (from medians of variants that ran and, where checked, matched the oracle): longctx
best vs the fastest peer, skipping on vs off (with the blocks computed off/on, free of timing
noise), xla vs splash per layout, zigzag vs contiguous per impl.
"""
from __future__ import annotations

import math

import bench_common as bc

PEERS = ("maxtext", "ringattention")
PEER_TITLES = {"maxtext": "MaxText tokamax ring (`maxtext==0.2.5`)",
               "ringattention": "lhao499 `ringattention==0.1.2`"}
CASE_ORDER = ("causal", "docs9", "docs_s32", "gqa", "window")  # for JSON without settings.cases


def _ms(t):
    return f"{t * 1e3:,.0f}"


def cell(rec, key="median_s"):
    """A variant's median in ms, or why it has none (rejects / fails), table-safe."""
    if rec is None:
        return "-"
    if key not in rec:
        status = rec.get("status", "")
        kind, _, why = status.partition(": ")
        if kind not in ("rejects", "fails"):
            return "-"
        why = why.split("; ")[0].split(". ")[0].replace("|", "/")  # first clause, table-safe
        return f"({kind}: {why[:70] + '...' if len(why) > 70 else why})"
    mark = ""
    if rec.get("status") == "WRONG":
        mark = " **WRONG**"
    return _ms(rec[key]) + mark


def _blocks_ratio(row, name):
    on, off = row["variants"].get(name, {}), row["variants"].get(name + "/noskip", {})
    if "computed_blocks" in on and "computed_blocks" in off and on["computed_blocks"]:
        return f" ({off['computed_blocks']}/{on['computed_blocks']} = "  \
               f"{off['computed_blocks'] / on['computed_blocks']:.2f}x)"
    return ""


def _good(rec, key="median_s"):
    """Timed and (where checked) right."""
    return rec is not None and key in rec and rec.get("status") == "ok"


def _longctx(row, skip=True):
    return {n: r for n, r in row["variants"].items()
            if "impl" in r and r["skip_documents"] == skip}


def summary(row, key="median_s"):
    """The ratios of a row: longctx best vs fastest peer, skipping on vs off, xla vs splash,
    zigzag vs contiguous (all from medians of right, timed variants)."""
    s = {}
    on = {n: r[key] for n, r in _longctx(row).items() if _good(r, key)}
    peers = {n: r[key] for n, r in row["variants"].items() if "peer" in r and _good(r, key)}
    if on:
        best = min(on, key=on.get)
        s["longctx_best"] = [best, on[best]]
    if peers:
        fastest = min(peers, key=peers.get)
        s["fastest_peer"] = [fastest, peers[fastest]]
    if on and peers:
        s["peer_over_longctx_best"] = peers[fastest] / on[best]
    off = {n: r[key] for n, r in _longctx(row, False).items() if _good(r, key)}
    if off:
        s["skip_speedup"] = {n: off[n + "/noskip"] / on[n] for n in on if n + "/noskip" in off}
    for impl in ("splash", "xla"):
        c, z = on.get(f"{impl}/contiguous"), on.get(f"{impl}/zigzag")
        if c and z:
            s[f"{impl}_zigzag_over_contiguous"] = z / c
    for layout in ("contiguous", "zigzag", "striped"):
        a, b = on.get(f"xla/{layout}"), on.get(f"splash/{layout}")
        if a and b:
            s.setdefault("xla_over_splash", {})[layout] = a / b
    return s


def targets(result, key="median_s"):
    """One line per target of the ring's work, from medians of `key` (wall or process CPU time)."""
    rows = {(r["case"], r["seq_len"]): r for r in result["rows"]}
    big = max((r["seq_len"] for r in result["rows"]), default=None)
    unit = "ms" if key == "median_s" else "CPU ms"
    lines = []

    def verdict(ok):
        return "met" if ok else "MISSED"

    r = rows.get(("causal", big))
    if r:
        mt = r["variants"].get("maxtext")
        splash = {n: v[key] for n, v in _longctx(r).items() if v["impl"] == "splash" and _good(v, key)}
        if _good(mt, key) and splash:
            worst = max(splash, key=splash.get)
            ratio = splash[worst] / mt[key]
            lines.append(f"causal S={big}: longctx splash, every layout, no slower than MaxText's "
                         f"tokamax ring: slowest layout {worst} {_ms(splash[worst])} {unit} vs "
                         f"{_ms(mt[key])} = {ratio:.2f}x ({verdict(ratio <= 1.0)}; "
                         + ", ".join(f"{n} {t / mt[key]:.2f}x" for n, t in splash.items()) + ")")
        else:
            lines.append(f"causal S={big}: longctx splash vs MaxText: not measured (no --peers, or "
                         "MaxText did not run or was wrong)")
    worse, n_pairs = [], 0
    for r in result["rows"]:
        pairs = summary(r, key).get("xla_over_splash", {})
        n_pairs += len(pairs)
        worse += [f"{r['case']} S={r['seq_len']} {layout} {ratio:.2f}x"
                  for layout, ratio in pairs.items() if ratio > 1.0]
    if n_pairs:
        lines.append(f"xla <= splash-interpret, every case and layout: {n_pairs - len(worse)}/{n_pairs} "
                     f"({verdict(not worse)}{'; xla slower: ' + ', '.join(worse) if worse else ''})")
    r = rows.get(("docs9", big))
    if r:
        s = summary(r, key)
        if "peer_over_longctx_best" in s:
            x = s["peer_over_longctx_best"]
            lines.append(f"docs9 S={big}: longctx best ({s['longctx_best'][0]}, "
                         f"{_ms(s['longctx_best'][1])} {unit}) {x:.2f}x faster than the fastest peer "
                         f"({s['fastest_peer'][0]}, {_ms(s['fastest_peer'][1])}) (target >= 2x: "
                         f"{verdict(x >= 2.0)})")
        else:
            lines.append(f"docs9 S={big}: vs the fastest peer: not measured (no --peers)")
    r = rows.get(("docs_s32", big))
    if r:
        sp = summary(r, key).get("skip_speedup", {})
        if sp:
            lo, hi = min(sp, key=sp.get), max(sp, key=sp.get)
            lines.append(f"docs_s32 S={big}: skipping on vs off, the same ring: best {sp[hi]:.2f}x "
                         f"({hi}; target >= 4x: {verdict(sp[hi] >= 4.0)}), every ring >= 4x: "
                         f"{verdict(sp[lo] >= 4.0)} ("
                         + ", ".join(f"{n} {v:.2f}x" for n, v in sp.items()) + ")")
    zz = []
    for r in result["rows"]:
        s = summary(r, key)
        zz += [(r, impl, s[f"{impl}_zigzag_over_contiguous"]) for impl in ("splash", "xla")
               if f"{impl}_zigzag_over_contiguous" in s]
    if zz:
        bad = [f"{r['case']} S={r['seq_len']} {impl} {ratio:.2f}x" for r, impl, ratio in zz
               if ratio > 1.10]
        causal_big = [f"{impl} {ratio:.2f}x" for r, impl, ratio in zz
                      if r["case"] == "causal" and r["seq_len"] == big]
        lines.append(f"zigzag within 10% of contiguous (zigzag / contiguous): causal S={big}: "
                     + ", ".join(causal_big) + f"; all (case, S, impl): {len(zz) - len(bad)}/{len(zz)} "
                     f"({verdict(not bad)}{'; over: ' + ', '.join(bad) if bad else ''})")
    return lines


def check_line(result):
    wrong = [f"{r['case']} S={r['seq_len']} {n}" for r in result["rows"]
             for n, v in r["variants"].items() if v.get("status") == "WRONG"]
    checked = sum(1 for r in result["rows"] for v in r["variants"].values() if "check" in v)
    return (f"checked against the dense oracle: {checked - len(wrong)}/{checked} variants within "
            f"tolerance{'; WRONG: ' + ', '.join(wrong) if wrong else ''}")


def max_errors(result):
    """Max abs error over all checked variants, per quantity, longctx and peers apart."""
    out = {}
    for r in result["rows"]:
        for n, v in r["variants"].items():
            if "check" not in v:
                continue
            who = "peers" if "peer" in v else "longctx"
            for q in ("out", "dq", "dk", "dv"):
                e = v["check"][f"{q}_max_abs_err"]
                out.setdefault(who, {}).setdefault(q, 0.0)
                out[who][q] = max(out[who][q], e) if math.isfinite(e) else float("nan")
    return out


def _table(result, key):
    st = result["settings"]
    peers = PEERS if st["peers"] else ()
    cols = [f"{impl}/{layout}" for impl in st["impls"] for layout in st["layouts"]]
    headers = (["case", "S"] + [PEER_TITLES[p] for p in peers]
               + [f"longctx {c.replace('/', ' ')}" for c in cols]
               + (["fastest peer / longctx best"] if peers else []))
    order = st.get("cases", CASE_ORDER)
    ordered = sorted(result["rows"], key=lambda r: (order.index(r["case"]) if r["case"] in order
                                                    else len(order), r["seq_len"]))
    rows = []
    for r in ordered:
        s = summary(r, key)
        rows.append([r["title"], f"{r['seq_len']:,}"]
                    + [cell(r["variants"].get(p), key) for p in peers]
                    + [cell(r["variants"].get(n), key) for n in cols]
                    + ([f"{s['peer_over_longctx_best']:.2f}x" if "peer_over_longctx_best" in s
                        else "-"] if peers else []))
    pad, tail = ["-"] * len(peers), ["-"] if peers else []
    for r in ordered:
        if not _longctx(r, False):
            continue
        sp = summary(r, key).get("skip_speedup", {})
        rows.append([f"same, skip_documents=False: {r['title']}", f"{r['seq_len']:,}"] + pad
                    + [cell(r["variants"].get(n + "/noskip"), key) for n in cols] + tail)
        rows.append([f"skipping on vs off: x faster (blocks computed off/on): {r['title']}",
                     f"{r['seq_len']:,}"] + pad
                    + [(f"{sp[n]:.2f}x" if n in sp else "-") + _blocks_ratio(r, n) for n in cols]
                    + tail)
    return bc.table(headers, rows)


def markdown(result):
    m, st = result["machine"], result["settings"]
    heads, window = st.get("heads", 4), st.get("window", 256)
    err = max_errors(result)
    fmt = lambda d: ", ".join(f"{q} {e:.1e}" for q, e in d.items())  # noqa: E731
    load = result.get("load_avg")
    has_cpu = any("median_cpu_s" in v for r in result["rows"] for v in r["variants"].values())
    out = [
        "## Ring attention on issue 12's work: longctx impl x layout, document skipping, peers "
        "(`bench_ring.py`)\n",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPU cores ({m['cpu_model'] + ', ' if 'cpu_model' in m else ''}"
        f"shared), {m['devices']} virtual devices, jax "
        f"{m['jax']}, {m['date_utc']} UTC"
        + (f", load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"
           if load and "end" in load else "")
        + (f", {result['wall_s'] / 60:.0f} min" if "wall_s" in result else "") + ". "
        f"sp = {st['sp']}, {heads} heads (GQA: {heads}/2) x {st.get('head_dim', 64)}, block {st['block']} "
        "(min with L = S/sp; zigzag: with L/2, see `masks.default_block_size`), float32, batch 1 "
        "(docs9: 2). "
        f"Time: jit(forward + vjp over q, k, v), compile excluded, inputs already in each "
        f"layout; median of {st['repeats']} runs in ms, the variants of a row timed "
        "round-robin. splash = the Pallas TPU kernel in interpret mode (CPU). Peers run on the "
        "contiguous layout, their kernels in interpret mode where they are Pallas.\n",
        f"Every variant's output and dq, dk, dv were checked against the dense float32 oracle "
        f"(`reference_attention`, natural order) at S <= {st['check_up_to']:,} with atol = rtol "
        f"= {st['fwd_tol']['atol']:g} (output) and {st['grad_tol']['atol']:g} (gradients); **WRONG** marks a "
        f"variant outside them. Max abs errors seen: longctx {fmt(err.get('longctx', {}))}"
        + (f"; peers {fmt(err['peers'])}" if "peers" in err else "") + ". docs9: 8 random "
        "cuts per row, none on a shard boundary; docs S/32: 31 random cuts per row (random "
        f"lengths, mean S/32). Window: `sliding_window=({window}, 0)` with causal=True, token i "
        f"sees i-{window}..i. `skip_documents=False` is the same ring computing every block the "
        "causal mask keeps, documents masked element-wise only; blocks computed = (q block, kv "
        "block) pairs over rows, devices and ring steps (ops/tables.py).\n",
        "### Wall time (ms), median\n",
        _table(result, "median_s"),
    ]
    if has_cpu:
        out += ["\n### Process CPU time (ms, all threads), median\n",
                "The work done per run: less sensitive than wall time to other jobs on a shared "
                "machine (threads that spin while waiting count too).\n",
                _table(result, "median_cpu_s")]
    out += ["\n### Targets, by wall time\n"]
    out += [f"- {t}" for t in targets(result)] + [f"- {check_line(result)}"]
    if has_cpu:
        out += ["\n### The same targets, by process CPU time\n"]
        out += [f"- {t}" for t in targets(result, "median_cpu_s")]
    return "\n".join(out) + "\n"
