"""Passkey retrieval measured on CPU: docs/bench_needle.{json,md} and the heatmap docs/needle_cpu.png.

  .venv/bin/python benchmarks/bench_needle.py                          # both parts (~25 min on 2 cores)
  .venv/bin/python benchmarks/bench_needle.py --part=synthetic --seeds=0,1,2,3
  .venv/bin/python benchmarks/bench_needle.py --part=text --steps=2000 --workdir=runs/needle_cpu

synthetic: tests/evals/test_needle.py's retrieval run (the tiny model, 128-token rows over the 1x2x4
mesh, ring over sp=4) for several training seeds: accuracy with the needle on another ring shard
in the same document, in the previous document (document mask on), and the latter without the
document mask. Chance is 0.10.

text: the demo model (configs/base.py:tiny, byte tokenizer, 1,024-token sequences, ring over
sp=4) trained on the embedded corpus where half of the documents carry a passkey sentence and end
with the question and its answer, then evaluated by longctx.evals.needle (what scripts/eval_needle.py
runs) on haystacks of plain validation text: accuracy per length x depth, the heatmap in
docs/needle_cpu.png. Training also runs the train.eval_needle_every hook.
"""

from longctx import cli

cli.start()  # before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import needle_synthetic as synthetic  # noqa: E402  (benchmarks/ is on sys.path too)
from longctx import config as config_lib  # noqa: E402
from longctx.evals import inference, needle  # noqa: E402
from longctx import train  # noqa: E402
from longctx.data import prepare  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DOCS = os.path.join(ROOT, "docs")


def load_base_config(preset: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_base", os.path.join(ROOT, "configs", "base.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(preset)
    config.unlock()
    return config


GRID_LENGTHS = (32, 64, 96, 128)


def run_synthetic(seeds) -> tuple[list[dict], dict]:
    """Per seed, the three accuracies; for the first seed also the length x depth grid."""
    rows, grid = [], None
    for seed in seeds:
        config = load_base_config("tiny")
        config_lib.apply_overrides(config, synthetic.SYNTHETIC_OVERRIDES)
        start = time.time()
        runner = synthetic.train_synthetic(config, seed)
        found = synthetic.synthetic_report(runner)
        rows.append({"seed": seed, **found, "seconds": round(time.time() - start, 1)})
        print(f"bench_needle: synthetic seed {seed}: {rows[-1]}", flush=True)
        if grid is None:
            grid = synthetic.synthetic_grid(runner, GRID_LENGTHS, needle.DEFAULT_DEPTHS)
            grid["training_seed"] = seed
            needle.write_results(grid, os.path.join(DOCS, "needle_cpu"),
                                 title=f"synthetic retrieval over the sp=4 ring (seed {seed}, chance 0.10)")
    return rows, grid


def passkey_corpus(path: str, num_docs: int, seed: int) -> None:
    """jsonl of standard-library text chunks (150-1000 characters); half carry a passkey
    sentence at a random depth and end with the question and the answer."""
    sources = prepare.list_sources([sysconfig.get_paths()["stdlib"]], "*.py", prepare.STDLIB_EXCLUDE_DIRS)
    rng = np.random.default_rng(seed)
    with open(path, "w") as out:
        written = 0
        for src in sources:
            try:
                text = open(src.path, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            at = 0
            while at < len(text) and written < num_docs:
                n = int(rng.integers(150, 1000))
                chunk, at = text[at:at + n], at + n
                if rng.random() < 0.5:
                    key = "".join(str(d) for d in rng.integers(0, 10, needle.PASSKEY_DIGITS))
                    cut = int(rng.integers(0, len(chunk) + 1))
                    chunk = (chunk[:cut] + needle.NEEDLE.format(key=key) + chunk[cut:] + needle.QUESTION
                             + " " + key)
                out.write(json.dumps({"text": chunk}) + "\n")
                written += 1
            if written >= num_docs:
                return


def run_text(workdir: str, steps: int, num_docs: int, samples: int) -> dict:
    data_dir = os.path.join(workdir, "data")
    if not os.path.isfile(os.path.join(data_dir, prepare.METADATA)):
        os.makedirs(workdir, exist_ok=True)
        corpus = os.path.join(workdir, "passkey.jsonl")
        passkey_corpus(corpus, num_docs, seed=0)
        prepare.prepare([corpus], data_dir, tokenizer="byte", val_fraction=0.02, progress=False)
    config = load_base_config("tiny")
    config.data.path = data_dir
    config.train.update(num_steps=steps, eval_every=0, log_every=50, eval_needle_every=max(1, steps // 4))
    config.checkpoint.update(every_steps=steps)
    start = time.time()
    train.train_and_evaluate(config, os.path.join(workdir, "run"), evaluators=[needle.PASSKEY_EVALUATOR])
    trained_s = time.time() - start
    runner = inference.runner_from_checkpoint(os.path.join(workdir, "run"))
    tokenizer, documents = needle.validation_documents(runner.config, data_dir)
    result = needle.evaluate(runner, tokenizer, documents, samples=samples, seed=0)
    result.update(steps=steps, train_seconds=round(trained_s, 1), train_documents=num_docs)
    needle.write_results(result, os.path.join(workdir, "eval"), title=f"passkey retrieval, tiny model, {steps} CPU steps")
    return result


def _grid_table(result: dict) -> list[str]:
    lines = ["| length | " + " | ".join(f"{d:.0%}" for d in result["depths"]) + " |",
             "|---:|" + "---:|" * len(result["depths"])]
    return lines + [f"| {n:,} | " + " | ".join(f"{a:.2f}" for a in row) + " |"
                    for n, row in zip(result["lengths"], result["accuracy"])]


def write_docs(synthetic, grid, text, command: str) -> None:
    """docs/bench_needle.json (each part keeps its last measurement) and docs/bench_needle.md."""
    path = os.path.join(DOCS, "bench_needle.json")
    saved = json.load(open(path)) if os.path.isfile(path) else {}
    for key, value in (("synthetic", synthetic), ("synthetic_grid", grid), ("text", text)):
        if value is not None:
            saved[key] = value
            saved[f"{key}_command"] = command
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    lines = ["# Passkey retrieval on CPU", "",
             "Generated by benchmarks/bench_needle.py (commands below); figures in bench_needle.json.", ""]
    if saved.get("synthetic"):
        lines += ["## Across ring shards vs across documents (synthetic retrieval)", "",
                  f"`{saved['synthetic_command']}`. The tiny model of tests/evals/test_needle.py (2 layers, "
                  "d_model 64), 128-token rows on the 1x2x4 CPU mesh, ring over sp=4 (zigzag), 200 "
                  "training steps; the needle (a marker and one of 10 values) always sits on another "
                  "ring shard than the question. 128 held-out rows; chance 0.10.", "",
                  "| training seed | cross-shard | cross-document | cross-document, no document mask | s |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['seed']} | {r['cross_shard']:.2f} | {r['cross_document']:.2f} | "
                  f"{r['cross_document_without_mask']:.2f} | {r['seconds']} |" for r in saved["synthetic"]]
        lines.append("")
    if saved.get("synthetic_grid"):
        g = saved["synthetic_grid"]
        lines += ["### Length x depth ([needle_cpu.png](needle_cpu.png))", "",
                  f"The seed-{g['training_seed']} model; a haystack of n tokens is the last n of the row "
                  "(padding before it), the needle at the depth shown, "
                  f"{g['samples_per_cell']} rows per cell. Mean accuracy {g['mean_accuracy']:.2f}.", ""]
        lines += _grid_table(g) + [""]
    if saved.get("text"):
        t = saved["text"]
        lines += ["## Passkey in text (longctx.evals.needle.evaluate, what scripts/eval_needle.py runs)", "",
                  f"`{saved['text_command']}`. configs/base.py:tiny (byte tokenizer, 1,024-token sequences, "
                  f"mesh 1x2x4) trained {t['steps']} steps ({t['train_seconds']} s) on the embedded corpus, "
                  "half of the documents carrying a passkey sentence and ending with the question and "
                  f"answer; haystacks of plain validation text, {t['samples_per_cell']} passkeys per "
                  f"cell, greedy exact match. Mean accuracy {t['mean_accuracy']:.2f}.", ""]
        lines += _grid_table(t) + [""] + ([t["note"], ""] if t.get("note") else [])
    with open(os.path.join(DOCS, "bench_needle.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--part", choices=("all", "synthetic", "text"), default="all")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--docs", type=int, default=8000, help="training documents of the text part")
    p.add_argument("--samples", type=int, default=4, help="passkeys per (length, depth) cell")
    p.add_argument("--workdir", default="runs/needle_cpu")
    args = p.parse_args(argv)
    cli.validated("the flags are fine")
    from absl import logging

    logging.set_verbosity(logging.ERROR)
    synthetic = grid = text = None
    if args.part in ("all", "synthetic"):
        synthetic, grid = run_synthetic([int(s) for s in args.seeds.split(",")])
        os.replace(os.path.join(DOCS, "needle_cpu", "needle.png"), os.path.join(DOCS, "needle_cpu.png"))
        os.replace(os.path.join(DOCS, "needle_cpu", "needle.json"), os.path.join(DOCS, "needle_cpu.json"))
        os.rmdir(os.path.join(DOCS, "needle_cpu"))
    if args.part in ("all", "text"):
        text = run_text(args.workdir, args.steps, args.docs, args.samples)
    write_docs(synthetic, grid, text, bc.command_line())
    print(f"bench_needle: wrote {DOCS}/bench_needle.md")
    return 0


if __name__ == "__main__":
    cli.run(main)
