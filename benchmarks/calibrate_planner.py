"""The planner's models against measurements: step time against published TPU step times and
this repository's own timings on a TPU v5e chip (the attention kernels, docs/tpu_kernels.json;
train steps, docs/tpu.md), HBM against this repository's whole-step TPU compiles. Fits the
constants, reports the error on the points not used for fitting apart. Writes
docs/planner_calibration.json and .md.

  .venv/bin/python benchmarks/calibrate_planner.py             # fit, compare, write (about ten seconds)
  .venv/bin/python benchmarks/calibrate_planner.py --render-only

Step time: longctx/plan/calibration.py's POINTS (each with its source) and plan/chip_points.py's
kernel rows and train steps, constants fitted by calibration.fit on the points marked fit; the
kernel's error by head width also from fits that leave each width out. HBM: the compiles of docs/fit_llama3_8b.json,
fit_llama3_8b_save_qkv.json, fit_llama3_70b.json and fit_strategies.json (scripts/estimate.py,
benchmarks/fit_strategies.py), memory_model.ACTIVATION_SCALE fitted on fit_llama3_8b.json's.
The fitted values are what longctx/plan/step_time.py and memory_model.py hold
(tests/plan/test_planner.py checks they agree).
"""
from longctx import cli

cli.start()

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import bench_tpu_kernels  # noqa: E402  (its documents: the kernel rows' segment ids)

from longctx.plan import calibration, chip_points, hardware, memory_model, step_time  # noqa: E402

SECTION = "planner_calibration"
CHIP_PRESET = "v5e_0p5b"  # the preset chip_points.STEPS override
MEASURED_CHIPS = sorted({hardware.parse_topology(s.topology).chip.name for s in chip_points.STEPS})
# (docs JSON, whether its points fit the memory scale)
MEMORY_SOURCES = (("fit_llama3_8b.json", True), ("fit_llama3_8b_save_qkv.json", False),
                  ("fit_llama3_70b.json", False), ("fit_strategies.json", False))
STRATEGY_OVERRIDES = {"ring": {"cp": "ring"}, "all_gather": {"cp": "all_gather"},
                      "ulysses": {"cp": "ulysses"}, "usp x4": {"cp": "usp", "cp_ulysses": 4}}


def _preset_and_attention(command: str) -> tuple[str, dict]:
    """The preset and attention overrides an estimate.py command line names."""
    preset = command.split("configs/base.py:")[1].split()[0]
    attention = {}
    for word in command.split():
        if word.startswith("--config.attention."):
            key, _, value = word[len("--config.attention."):].partition("=")
            attention[key] = int(value) if value.isdigit() else value
    return preset, attention


def _memory_point(label, preset, attention, point, fit):
    config = copy.deepcopy(bc.base_config(preset))
    config.unlock()
    mesh = point["mesh_shape"]
    config.mesh.update(**mesh)
    config.data.update(seq_len=point["seq_len"], global_batch_size=point["global_batch_size"])
    config.attention.update(**attention)
    config.lock()
    return calibration.MemoryPoint(label, config, mesh, int(point["total_bytes"]), fit)


def memory_points() -> list:
    out = []
    for name, fit in MEMORY_SOURCES:
        with open(os.path.join(bc.DOCS, name)) as f:
            doc = json.load(f)
        if "cells" in doc:  # fit_strategies.json
            for cell in doc["cells"]:
                for strategy, p in cell["strategies"].items():
                    if "total_bytes" in p:
                        label = f"{cell['preset']} S={cell['seq_len']:,} sp={cell['sp']} {strategy}"
                        out.append(_memory_point(f"{name}: {label}", cell["preset"],
                                                 STRATEGY_OVERRIDES[strategy], p, fit))
            continue
        preset, attention = _preset_and_attention(doc["command"])
        for p in doc["points"]:
            if "total_bytes" in p:
                label = f"{preset} {p['topology']} S={p['seq_len']:,} sp={p['sp']} {attention}"
                out.append(_memory_point(f"{name}: {label}", preset, attention, p, fit))
    return out


def _error_summary(rows) -> dict:
    fitted = [abs(r["error"]) for r in rows if r["fit"]]
    held = [abs(r["error"]) for r in rows if not r["fit"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"fit_points": len(fitted), "fit_mean_abs_error": mean(fitted),
            "held_out_points": len(held), "held_out_mean_abs_error": mean(held),
            "held_out_max_abs_error": max(held, default=None)}


def kernel_rows() -> list:
    with open(os.path.join(bc.DOCS, "tpu_kernels.json")) as f:
        return chip_points.kernel_rows(json.load(f))


def kernel_result(rows, constants) -> dict:
    """Each kernel row's error under `constants`, and per head width the mean absolute error
    (forward + backward, and forward) of the fitted rows, of the same rows under a fit that
    left that width out, of longctx's held-out rows and of stock splash's."""
    segments = bench_tpu_kernels._segments
    cache: dict = {}
    out = []
    for r in rows:
        e = calibration.kernel_error(r, constants, segments(r.seq_len), cache)
        out.append({"label": r.label, "impl": r.impl, "mask": r.mask, "seq_len": r.seq_len,
                    "head_dim": r.head_dim, "block": r.block, "fit": r.fit,
                    "forward_ms": r.forward_ms, "forward_backward_ms": r.forward_backward_ms,
                    "forward_error": e["forward"], "forward_backward_error": e["forward_backward"]})
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    by_width = []
    for width in sorted({r.head_dim for r in rows}):
        left_out = {**constants, **calibration.fit_kernel(rows, constants, segments, without_head_dim=width)}
        fitted = [r for r in rows if r.fit and r.head_dim == width]
        unseen = [calibration.kernel_error(r, left_out, segments(r.seq_len)) for r in fitted]
        pick = lambda fit, impl: [o for o in out if o["head_dim"] == width and o["fit"] == fit  # noqa: E731
                                  and o["impl"] == impl]
        by_width.append({
            "head_dim": width, "fit_rows": len(fitted),
            "fit_error": mean([abs(o["forward_backward_error"]) for o in pick(True, "longctx")]),
            "width_left_out_error": mean([abs(u["forward_backward"]) for u in unseen]),
            "width_left_out_forward_error": mean([abs(u["forward"]) for u in unseen]),
            "held_out_rows": len(pick(False, "longctx")),
            "held_out_error": mean([abs(o["forward_backward_error"]) for o in pick(False, "longctx")]),
            "stock_rows": len(pick(False, "stock")),
            "stock_error": mean([abs(o["forward_backward_error"]) for o in pick(False, "stock")])})
    return {"rows": out, "by_head_width": by_width}


def chip_step_rows(preset, constants) -> list[dict]:
    rows = []
    for p in chip_points.STEPS:
        e = chip_points.predict_step(preset, p, constants)
        rows.append({"label": p.label, "topology": p.topology, "fit": p.fit, "source": p.source,
                     "measured_seconds": p.measured_seconds, "predicted_seconds": e.seconds,
                     "error": e.seconds / p.measured_seconds - 1.0, "predicted_mfu": e.mfu,
                     "matmul_seconds": e.matmul, "attention_seconds": e.attention})
    return rows


def block_ratios(base, kernel, constants) -> list[dict]:
    """Attention at blocks of 512 over blocks of 1,024, by the model: the 8B ring at 1M tokens
    on v5p (sp=64, the recipe's heads of 256 and Llama 3's of 128), and longctx's causal kernel at
    32,768 tokens on the v5e chip beside what the chip measured (forward + backward)."""
    point = next(p for p in calibration.POINTS if p.model == "llama3.1-8b-hd256"
                 and p.seq_len == 1_048_576 and p.topology.startswith("v5p"))
    out = []
    for name, model in (("ring, 1M tokens, v5p, sp=64, heads of 256", "llama3.1-8b-hd256"),
                        ("ring, 1M tokens, v5p, sp=64, heads of 128", "llama3-8b")):
        t = {b: calibration.predict(base, dataclasses.replace(point, model=model, block=b),
                                    constants).attention for b in (512, 1024)}
        out.append({"case": name, "predicted": t[512] / t[1024], "measured": None})
    rows = {(r["impl"], r["head_dim"], r["block"]): r for r in kernel["rows"]
            if r["mask"] == "causal" and r["seq_len"] == 32_768}
    for width in (64, 128, 256):
        if ("longctx", width, 512) in rows and ("longctx", width, 1024) in rows:
            a, b = rows[("longctx", width, 512)], rows[("longctx", width, 1024)]
            predicted = ((1 + a["forward_backward_error"]) * a["forward_backward_ms"]
                         / ((1 + b["forward_backward_error"]) * b["forward_backward_ms"]))
            out.append({"case": f"longctx kernel, 32K causal, v5e, heads of {width}",
                        "predicted": predicted,
                        "measured": a["forward_backward_ms"] / b["forward_backward_ms"]})
    return out


def _chip_own(key: str) -> bool:
    """Whether a constant is a measured chip's own (fitted on chip_points, not the published runs)."""
    return any(key.endswith(f"_{chip}") for chip in MEASURED_CHIPS)


def markdown(result) -> str:
    t, m = result["step_time"], result["memory"]
    pct = lambda x: "n/a" if x is None else f"{x:+.0%}"  # noqa: E731
    apct = lambda x: "n/a" if x is None else f"{x:.0%}"  # noqa: E731
    lines = ["# Planner calibration\n",
             f"Generated by `{result['command']}` (`benchmarks/calibrate_planner.py`). The step-time "
             "model (`longctx/plan/step_time.py`) against published TPU step times and against train "
             "steps and attention kernels measured on a TPU v5e chip here, and the memory "
             "model (`longctx/plan/memory_model.py`) against this repository's whole-step TPU compiles. "
             "Points marked **fit** set the constants; the error on the others (held out) is reported "
             "apart. What the models assume and how to read the errors: [planner.md](planner.md).\n",
             "## Step time\n",
             f"Constants fitted on {t['summary']['fit_points']} points: " +
             ", ".join(f"`{k}` = {v}" for k, v in t["constants"].items() if not _chip_own(k)) + ". "
             f"Mean absolute error: **{apct(t['summary']['held_out_mean_abs_error'])} on "
             f"{t['summary']['held_out_points']} held-out points** (largest "
             f"{apct(t['summary']['held_out_max_abs_error'])}); "
             f"{apct(t['summary']['fit_mean_abs_error'])} on the fitted ones.\n"]
    if t.get("by_length"):
        lines.append("Mean absolute error by sequence length, fitted and held-out points apart "
                     "(a range with no published point says so):\n")
        lines.append(bc.table(["tokens", "fitted points", "fitted error", "held-out points",
                               "held-out error"],
                              [[g["range"], g["fit_points"], apct(g["fit_mean_abs_error"]),
                                g["held_out_points"], apct(g["held_out_mean_abs_error"])]
                               for g in t["by_length"]]))
        lines.append("")
    header = ["run", "slice", "mesh dp,fsdp,sp", "published s", "predicted s", "error",
              "predicted MFU", "fit", "source"]
    body = [[r["label"], r["topology"], ",".join(str(v) for v in r["mesh"].values()),
             f"{r['published_seconds']:.3g}", f"{r['predicted_seconds']:.3g}", pct(r["error"]),
             f"{r['predicted_mfu']:.0%}", "**fit**" if r["fit"] else "", r["source"]]
            for r in t["rows"]]
    lines += [bc.table(header, body), ""]
    if t.get("rank_agreement"):
        lines.append("Within each published table (one shape, several strategies), does the model "
                     "order the strategies as measured?\n")
        lines.append(bc.table(["table", "published fastest", "predicted fastest", "pairs ordered alike"],
                              [[g["table"], g["published_best"], g["predicted_best"],
                                f"{g['concordant']}/{g['pairs']}"] for g in t["rank_agreement"]]))
        lines.append("")
    chip = t.get("chip_steps")
    if chip:
        c = result["chip"]
        lines += ["## Measured on the chip here: train steps\n",
                  "The chip's own constants (`step_time.chip_constant`), fitted on its kernels "
                  "and train steps below given the published ones: " +
                  ", ".join(f"`{k}` = {v}" for k, v in t["constants"].items() if _chip_own(k)) + ". "
                  f"Train steps of `configs/base.py:{c['preset']}` (one causal row, at blocks of 1,024 "
                  "unless named) measured on one TPU v5e chip by this repository (median of the "
                  "steps after the first, "
                  "[tpu.md](tpu.md)), priced at each run's own config on `v5e:1x1`. The **fit** "
                  "ones set `matmul_v5e`; the others are held out. Mean absolute error "
                  f"**{apct(c['summary']['held_out_mean_abs_error'])} on "
                  f"{c['summary']['held_out_points']} held-out steps** (largest "
                  f"{apct(c['summary']['held_out_max_abs_error'])}); "
                  f"{apct(c['summary']['fit_mean_abs_error'])} on the fitted ones.\n"]
        lines += [bc.table(["run", "measured s", "predicted s", "error", "matmul s", "attention s",
                            "fit", "source"],
                           [[r["label"], f"{r['measured_seconds']:.3f}", f"{r['predicted_seconds']:.3f}",
                             pct(r["error"]), f"{r['matmul_seconds']:.3f}", f"{r['attention_seconds']:.3f}",
                             "**fit**" if r["fit"] else "", r["source"]] for r in chip]), ""]
    k = result.get("kernel")
    if k:
        lines += ["## Measured on the chip here: the attention kernel\n",
                  "One attention call on one TPU v5e chip (heads 8 x d, batch 1: "
                  "[tpu_kernels.md](tpu_kernels.md)), priced as the step prices one layer's "
                  "(`step_time.attention_pass_seconds`). The **fit** rows (longctx's kernels at "
                  "32K and 64K tokens, blocks of 512, 1,024 and 2,048, causal and window) set v5e's own "
                  "`attention_v5e`, `block_overhead_v5e` and `score_element_v5e` (the launch and "
                  "dead-step costs are the published runs'). Error of forward + backward, mean "
                  "absolute, by head width: on the fitted rows; on the same rows under a fit that "
                  "left every row of that width out (the head-width dependence held out); on "
                  "longctx's held-out rows (8K tokens, documents); on stock "
                  "splash's (another kernel, held out):\n"]
        lines += [bc.table(["head width", "fitted rows", "fitted error", "width left out of the fit",
                            "(its forward)", "held-out rows", "held-out error", "stock rows", "stock error"],
                           [[g["head_dim"], g["fit_rows"], apct(g["fit_error"]),
                             apct(g["width_left_out_error"]), apct(g["width_left_out_forward_error"]),
                             g["held_out_rows"], apct(g["held_out_error"]), g["stock_rows"],
                             apct(g["stock_error"])] for g in k["by_head_width"]]), ""]
        lines += ["Blocks of 512 against blocks of 1,024 (attention seconds, the model's and the "
                  "chip's):\n",
                  bc.table(["case", "predicted 512 / 1,024", "measured"],
                           [[g["case"], f"{g['predicted']:.2f}x",
                             "" if g["measured"] is None else f"{g['measured']:.2f}x"]
                            for g in k["block_ratios"]]), ""]
        lines += [bc.table(["kernel row", "fwd ms", "predicted", "error", "fwd+bwd ms", "predicted",
                            "error", "fit"],
                           [[r["label"], f"{r['forward_ms']:.1f}",
                             f"{(1 + r['forward_error']) * r['forward_ms']:.1f}", pct(r["forward_error"]),
                             f"{r['forward_backward_ms']:.1f}",
                             f"{(1 + r['forward_backward_error']) * r['forward_backward_ms']:.1f}",
                             pct(r["forward_backward_error"]), "**fit**" if r["fit"] else ""]
                            for r in k["rows"]]), ""]
    lines += ["## HBM per chip\n",
              f"`ACTIVATION_SCALE` = {m['activation_scale']} fitted on {m['summary']['fit_points']} "
              f"compiles. Mean absolute error **{apct(m['summary']['held_out_mean_abs_error'])} on "
              f"{m['summary']['held_out_points']} held-out compiles** (largest "
              f"{apct(m['summary']['held_out_max_abs_error'])}); "
              f"{apct(m['summary']['fit_mean_abs_error'])} on the fitted ones. The planner only prunes "
              "with this model; its best rows are compiled for their true figure.\n"]
    body = [[r["label"], ",".join(str(v) for v in r["mesh"].values()),
             f"{r['measured_bytes'] / 2**30:.1f}", f"{r['predicted_bytes'] / 2**30:.1f}",
             pct(r["error"]), "**fit**" if r["fit"] else ""] for r in m["rows"]]
    lines += [bc.table(["compile", "mesh dp,fsdp,sp", "measured GiB", "predicted GiB", "error", "fit"],
                       body), ""]
    return "\n".join(lines)


def rank_agreement(rows) -> list[dict]:
    """Per published table with several strategies of one shape: the fastest, and how many
    pairs the model orders as measured."""
    groups = {}
    for r in rows:
        key = (r["source"], r["label"].split(" ")[0], r["label"].split(" ")[1], r["label"].split("(")[-1])
        groups.setdefault(key, []).append(r)
    out = []
    for (source, model, seq, layout), rs in groups.items():
        if len(rs) < 2:
            continue
        pairs = [(a, b) for i, a in enumerate(rs) for b in rs[i + 1:]]
        same = sum((a["published_seconds"] < b["published_seconds"]) ==
                   (a["predicted_seconds"] < b["predicted_seconds"]) for a, b in pairs)
        name = lambda r: r["label"].split(" ", 2)[2]  # noqa: E731
        out.append({"table": f"{model} {seq} ({layout.rstrip(')')}), {source.split(' (')[0]}",
                    "published_best": name(min(rs, key=lambda r: r["published_seconds"])),
                    "predicted_best": name(min(rs, key=lambda r: r["predicted_seconds"])),
                    "concordant": same, "pairs": len(pairs)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_page_arguments(ap, SECTION)
    args = ap.parse_args()
    if bc.render_only(args, markdown):
        return 0
    cli.validated(f"{len(calibration.POINTS)} published points")
    base = bc.base_config("")
    preset = bc.base_config(CHIP_PRESET)
    kernels = kernel_rows()
    constants = calibration.fit(base, kernel_rows=kernels, segments=bench_tpu_kernels._segments,
                                preset=preset, steps=chip_points.STEPS)
    rows = calibration.compare(base, constants=constants)
    chip_rows = chip_step_rows(preset, constants)
    kernel = kernel_result(kernels, constants)
    kernel["block_ratios"] = block_ratios(base, kernel, constants)
    points = memory_points()
    scale = calibration.fit_activation_scale(points)
    memory_rows = calibration.compare_memory(points, scale)
    result = {"command": bc.command_line(),
              "step_time": {"constants": constants, "in_step_time_py": step_time.CONSTANTS,
                            "rows": rows, "summary": _error_summary(rows),
                            "by_length": calibration.by_length(rows),
                            "rank_agreement": rank_agreement(rows), "chip_steps": chip_rows},
              "chip": {"preset": CHIP_PRESET, "summary": _error_summary(chip_rows)},
              "kernel": kernel,
              "memory": {"activation_scale": scale,
                         "in_memory_model_py": memory_model.ACTIVATION_SCALE,
                         "rows": memory_rows, "summary": _error_summary(memory_rows)}}
    bc.write_json(args.json, result)
    bc.write_markdown(args.md, markdown(result))
    print(markdown(result))
    if constants != step_time.CONSTANTS or scale != memory_model.ACTIVATION_SCALE:
        print(f"\nnote: the fit differs from what longctx holds: step_time.CONSTANTS = {constants}, "
              f"memory_model.ACTIVATION_SCALE = {scale}")
    return 0


if __name__ == "__main__":
    cli.run(main)
