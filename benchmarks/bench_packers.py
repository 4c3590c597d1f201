"""Step time of `configs/base.py:long_cpu` (65,536 tokens, sp=8) under each packer, on the embedded
corpus: data.packer=shard_balanced (contiguous) against best_fit in every layout; or with --new
any other packer/layout against the same (the per-document layout: --new best_fit/per_document).

  .venv/bin/python benchmarks/bench_packers.py                  # 3 seeds, 6 steps (~45 minutes)
  .venv/bin/python benchmarks/bench_packers.py --quick          # 1 seed, 3 steps, 2 variants
  .venv/bin/python benchmarks/bench_packers.py --new best_fit/per_document --layouts striped \\
      --seeds 0,1 --json docs/bench_packers_per_document.json    # against today's best layout

Each run is scripts/train.py in its own process (what a user runs), with train.num_steps=--steps
and config.seed = data.shuffle_seed = <seed>: a seed changes the model's initialisation and the
documents' order, so the packers are compared over 3 x (steps - 1) rows each. Runs alternate between the variants within a seed, so that the machine's drift falls on
all of them alike. The first seed runs best_fit in every layout; later seeds run best_fit in
the one that was fastest there ("today's best layout") beside shard_balanced.

A variant's time is the median of step_time_s over steps 2..--steps (step 1 compiles), pooled
over the seeds; its loss is the mean train loss over a run's steps, per seed, and the seeds'
spread of it (max - min) is the noise the two packers' losses are held against. Writes docs/bench_packers.json
and its section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=None)  # the runs are child processes; this one runs no jax

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

NEW = ("shard_balanced", "contiguous")
TODAY = "best_fit"
LAYOUTS = ("contiguous", "zigzag", "striped")


def section(new) -> str:
    """The section of docs/benchmarks.md a comparison writes: packers_long_cpu for shard_balanced's."""
    return "packers_long_cpu" if tuple(new) == NEW else f"{new[0]}_{new[1]}_long_cpu"


def run(packer: str, layout: str, seed: int, args) -> dict:
    """One training run; its per-step metrics (step, loss, step_time_s)."""
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [sys.executable, os.path.join(bc.REPO, "scripts", "train.py"),
               f"--config=configs/base.py:{args.preset}", f"--workdir={workdir}",
               f"--config.data.packer={packer}", f"--config.attention.layout={layout}",
               f"--config.seed={seed}", f"--config.data.shuffle_seed={seed}",
               f"--config.train.num_steps={args.steps}", *args.override]
        result = subprocess.run(cmd, cwd=bc.REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    return {"packer": packer, "layout": layout, "seed": seed,
            "steps": [{"step": m["step"], "loss": m["train/loss"], "step_time_s": m.get("train/step_time_s")}
                      for m in steps]}


def timed(record: dict) -> list[float]:
    return [m["step_time_s"] for m in record["steps"] if m["step"] >= 2 and m["step_time_s"]]


def mean_loss(record: dict) -> float:
    return statistics.fmean(m["loss"] for m in record["steps"])


def summarize(runs: list[dict], new_name=NEW) -> dict:
    variants = {}
    for r in runs:
        v = variants.setdefault(f"{r['packer']}/{r['layout']}", {"times": [], "loss": {}})
        v["times"] += timed(r)
        v["loss"][r["seed"]] = mean_loss(r)
    for v in variants.values():
        v["median_step_s"] = statistics.median(v["times"]) if v["times"] else None
        losses = list(v["loss"].values())
        v["mean_loss"] = statistics.fmean(losses)
        v["loss_spread"] = max(losses) - min(losses)
    new = variants.get("/".join(new_name))
    today = {k: v for k, v in variants.items() if k.startswith(TODAY + "/") and k != "/".join(new_name)
             and len(v["loss"]) == len(new["loss"])} if new else {}
    out = {"variants": variants}
    if new and today:
        best = min(today, key=lambda k: today[k]["median_step_s"])
        noise = max(new["loss_spread"], today[best]["loss_spread"])
        out.update(best_today=best, time_ratio=new["median_step_s"] / today[best]["median_step_s"],
                   loss_difference=new["mean_loss"] - today[best]["mean_loss"],
                   loss_noise=noise)
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    new = tuple(result["settings"].get("new", NEW))
    rows = [[name, f"{v['median_step_s']:.1f}", len(v["times"]),
             ", ".join(f"{loss:.3f}" for loss in v["loss"].values()), f"{v['loss_spread']:.3f}"]
            for name, v in s["variants"].items()]
    title = "Packers" if new == NEW else f"{new[0]}, {new[1]} layout,"
    lines = [f"## {title} on long_cpu ({section(new)})", "",
             f"`{result['command']}` ({result['machine']['cpu_model']}, "
             f"{result['machine']['cpu_count']} cores, {result['machine']['date_utc']} UTC). "
             f"configs/base.py:{result['settings']['preset']}, steps 2-{result['settings']['steps']} "
             f"of each run, seeds {result['settings']['seeds']}.", "",
             bc.table(["packer/layout", "median step s", "steps timed", "mean loss per seed",
                       "loss spread"], rows), ""]
    if "time_ratio" in s:
        lines.append(f"{'/'.join(new)} vs {s['best_today']} (today's fastest layout here): "
                     f"**{s['time_ratio']:.2f}x** the step time (target <= 0.9x: "
                     f"{'met' if s['time_ratio'] <= 0.9 else 'MISSED'}); the mean loss differs by "
                     f"{s['loss_difference']:+.3f} against a seed spread of {s['loss_noise']:.3f} "
                     f"({'within' if abs(s['loss_difference']) <= s['loss_noise'] else 'OUTSIDE'} the noise).")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="long_cpu")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="1 seed, 3 steps, best_fit in contiguous only")
    p.add_argument("--new", default="/".join(NEW),
                   help="PACKER/LAYOUT to hold against best_fit in its fastest layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="the layouts best_fit runs in at the first seed (the fastest runs at the others)")
    p.add_argument("--override", action="append", default=[],
                   help="more --config.KEY=VALUE flags for every run (e.g. a smaller seq_len)")
    bc.add_output_arguments(p, "bench_packers", render_only_help="rewrite the section from --json's runs")
    args = p.parse_args()
    new = tuple(args.new.split("/"))
    if args.render_only:  # the figures again from the runs' metrics, nothing run
        with open(args.json) as f:
            result = json.load(f)
        result["summary"] = summarize(result["runs"], tuple(result["settings"].get("new", NEW)))
        bc.write_section(section(result["settings"].get("new", NEW)), markdown(result), args.md)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    cli.validated(f"{len(seeds)} seed(s) of configs/base.py:{args.preset}")  # under --validate_only
    layouts = tuple(args.layouts.split(","))
    if args.quick:
        seeds, args.steps, layouts = seeds[:1], 3, ("contiguous",)
    runs = []
    for i, seed in enumerate(seeds):
        variants = [new] + [(TODAY, layout) for layout in layouts]
        if i:  # later seeds: today's fastest layout only (from the first seed)
            first = summarize(runs, new)["variants"]
            fastest = min((k for k in first if k.startswith(TODAY + "/") and k != "/".join(new)),
                          key=lambda k: first[k]["median_step_s"])
            variants = [new, tuple(fastest.split("/"))]
        if i % 2:
            variants = variants[::-1]  # alternate which goes first
        for packer, layout in variants:
            record = run(packer, layout, seed, args)
            print(f"seed {seed} {packer}/{layout}: steps 2+ "
                  f"{', '.join(f'{t:.1f}' for t in timed(record))} s, mean loss "
                  f"{mean_loss(record):.4f}", flush=True)
            runs.append(record)
    machine = {"cpu_model": bc.cpu_model(), "cpu_count": os.cpu_count(),
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}  # the runs' jax: 8 CPU devices
    result = {"command": bc.command_line(), "machine": machine,
              "settings": {"preset": args.preset, "steps": args.steps, "seeds": seeds,
                           "override": args.override, "new": list(new)},
              "runs": runs, "summary": summarize(runs, new)}
    bc.write_json(args.json, result)
    bc.write_section(section(new), markdown(result), args.md)
    print(markdown(result))


if __name__ == "__main__":
    cli.run(main)
