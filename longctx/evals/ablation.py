"""Config-driven ablations: run every variant of a grid, then compare them in one table and plots.

A grid file (configs/ablations/*.py) defines `BASE` ("configs/base.py:preset"), `COMMON` (overrides
for every variant) and `get_grid() -> {variant: overrides}`. Each variant is an ordinary training
run in `workdir/<variant>`; a finished one is skipped, an unfinished one resumes from its checkpoint
(train_and_evaluate does that by itself), so re-running a grid only does the missing work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from typing import Any

from longctx.errors import ConfigError, RunError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (longctx/evals/ in a checkout)


@dataclasses.dataclass
class Variant:
    name: str
    overrides: dict[str, Any]
    config: Any  # the resolved ConfigDict

    def command(self, base: str, workdir: str) -> list[str]:
        flags = [f"--config.{k}={v}" for k, v in self.overrides.items()]
        return [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--config={base}",
                f"--workdir={os.path.join(workdir, self.name)}", *flags]


def _load_module(path: str, name: str):
    if not os.path.isfile(path):
        raise ConfigError(f"grid file {path} does not exist.")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _base_config(base: str):
    path, _, preset = base.partition(":")
    module = _load_module(os.path.join(REPO, path) if not os.path.isabs(path) else path, "longctx_base_config")
    return module.get_config(preset)


def _apply(config, name: str, key: str, value) -> None:
    # lazily: longctx.config loads jax and the model (2 s), which scripts/ablate.py's parent
    # process, that only starts the runs, does without
    from longctx import config as config_lib

    try:
        config_lib.apply_overrides(config, {key: value})
    except (KeyError, AttributeError):
        raise ConfigError(f"grid variant {name!r}: unknown config key {key!r}.") from None
    except TypeError as e:
        raise ConfigError(f"grid variant {name!r}: {key}={value!r} has the wrong type ({e}).") from None


def load_grid(path: str) -> tuple[str, list[Variant]]:
    """(base config spec, variants); every key is checked before anything runs."""
    module = _load_module(path, "longctx_ablation_grid")
    for attr in ("BASE", "get_grid"):
        if not hasattr(module, attr):
            raise ConfigError(f"grid file {path} defines no {attr}.")
    common = getattr(module, "COMMON", {})
    variants = []
    for name, overrides in module.get_grid().items():
        merged = {**common, **overrides}
        config = _base_config(module.BASE)
        for key, value in merged.items():
            _apply(config, name, key, value)
        variants.append(Variant(name, merged, config))
    return module.BASE, variants


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def is_finished(variant: Variant, run_dir: str) -> bool:
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    return bool(steps) and max(steps) >= variant.config.train.num_steps


def run_grid(grid_path: str, workdir: str, *, dry_run: bool = False, echo=print) -> list[Variant]:
    """Runs each variant in turn (each its own training process, whose output follows a line
    "ablate: variant k of N (name): starting"), or with `dry_run` prints each command."""
    base, variants = load_grid(grid_path)
    for k, variant in enumerate(variants, 1):
        command = variant.command(base, workdir)
        if dry_run:
            echo(shlex.join(command))
            continue
        run_dir = os.path.join(workdir, variant.name)
        which = f"ablate: variant {k} of {len(variants)} ({variant.name})"
        if is_finished(variant, run_dir):
            echo(f"{which}: finished, skipping")
            continue
        echo(f"{which}: {'resuming' if os.path.isdir(run_dir) else 'starting'}")
        sys.stdout.flush()  # (before the run's own lines, also when stdout is a pipe)
        result = subprocess.run(command, cwd=REPO)
        if result.returncode != 0:
            raise RunError(f"variant {variant.name!r} failed with exit code {result.returncode} "
                           f"(its message is above): {shlex.join(command)}")
    return variants


def summarize(variants: list[Variant], workdir: str) -> list[dict]:
    rows = []
    for variant in variants:
        run_dir = os.path.join(workdir, variant.name)
        records = read_metrics(run_dir)
        train = [r for r in records if "train/loss" in r]
        val = [r for r in records if "val/loss" in r]
        info_path = os.path.join(run_dir, "run_info.json")
        info = json.load(open(info_path)) if os.path.isfile(info_path) else {}
        speeds = sorted(r["train/tokens_per_s"] for r in train if "train/tokens_per_s" in r)
        rows.append({
            "variant": variant.name,
            "steps": train[-1]["step"] if train else 0,
            "train_loss": train[-1]["train/loss"] if train else None,
            "val_loss": val[-1]["val/loss"] if val else None,
            "tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
            "schedule_efficiency": info.get("ring_schedule_efficiency"),
            "ring_steps": info.get("ring_steps_run"),
            "train_curve": [(r["step"], r["train/loss"]) for r in train],
            "position_loss": (val[-1].get("val/position_bucket_starts"), val[-1].get("val/loss_by_position"))
            if val else None,
        })
    return rows


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| variant | steps | train loss | val loss | tokens/s | ring schedule efficiency | ring steps |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['steps']} | {_cell(r['train_loss'], '.4f')} | "
                     f"{_cell(r['val_loss'], '.4f')} | {_cell(r['tokens_per_s'], '.0f')} | "
                     f"{_cell(r['schedule_efficiency'], '.3f')} | {_cell(r['ring_steps'], 'd')} |")
    return "\n".join(lines) + "\n"


def write_report(rows: list[dict], workdir: str, command: str) -> dict[str, str]:
    import matplotlib  # lazily: plotting only where the report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {k: os.path.join(workdir, f) for k, f in
             (("table", "ablation.md"), ("curves", "ablation.png"), ("position", "position_loss.png"))}
    with open(paths["table"], "w") as f:
        f.write(f"# Ablation\n\nProduced by `{command}`.\n\n" + markdown_table(rows))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["train_curve"]:
            steps, losses = zip(*r["train_curve"])
            ax.plot(steps, losses, label=r["variant"])
    ax.set(xlabel="step", ylabel="train loss", title="Training loss by variant")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["curves"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["position_loss"] and r["position_loss"][0]:
            starts, losses = r["position_loss"]
            points = [(s + 1, l) for s, l in zip(starts, losses) if l is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=r["variant"])
    ax.set_xscale("log", base=2)
    ax.set(xlabel="position in document (bucket start + 1, log scale)", ylabel="validation loss",
           title="Validation loss by token position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["position"], dpi=120)
    plt.close(fig)
    return paths
