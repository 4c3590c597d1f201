"""Config-driven ablations: run every variant of a grid, then compare them in one table and plots.

A grid file (configs/ablations/*.py) defines `BASE` ("configs/base.py:preset"), `COMMON` (overrides
for every variant) and `get_grid() -> {variant: overrides}`. Each variant is an ordinary training
run in `workdir/<variant>`; a finished one is skipped, an unfinished one resumes from its checkpoint
(train_and_evaluate does that by itself), so re-running a grid only does the missing work.

With N seeds (`scripts/ablate.py --seeds N`) each variant runs N times, seed `config.seed + k` in
`workdir/<variant>/seed_<seed>`, and the report gives each variant's mean and sample standard
deviation over its seeds (`aggregate`) and which variants' validation losses lie within each
other's spread (`within_spread`).
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
from longctx.evals import ablation_stats as stats

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (longctx/evals/ in a checkout)


@dataclasses.dataclass
class Variant:
    name: str
    overrides: dict[str, Any]
    config: Any  # the resolved ConfigDict

    def seeds(self, count: int) -> list[int | None]:
        """The seeds of `count` runs: None for one (the config's own seed, today's layout), else
        config.seed, config.seed + 1, ..."""
        return [None] if count == 1 else [int(self.config.seed) + k for k in range(count)]

    def run_dir(self, workdir: str, seed: int | None = None) -> str:
        return os.path.join(workdir, self.name, *([] if seed is None else [f"seed_{seed}"]))

    def command(self, base: str, workdir: str, seed: int | None = None) -> list[str]:
        # a dict value (a ConfigDict-valued key such as attention.layer_types) is its Python
        # literal, which ml_collections' flag parser reads back as a ConfigDict
        flags = [f"--config.{k}={v}" for k, v in self.overrides.items()]
        if seed is not None:
            flags.append(f"--config.seed={seed}")
        return [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--config={base}",
                f"--workdir={self.run_dir(workdir, seed)}", *flags]


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


def run_grid(grid_path: str, workdir: str, *, seeds: int = 1, dry_run: bool = False,
             echo=print) -> list[Variant]:
    """Runs each variant in turn, `seeds` times (each run its own training process, whose output
    follows a line "ablate: variant k of N (name): starting", with ", seed s (j of M)" where
    seeds > 1), or with `dry_run` prints each command."""
    base, variants = load_grid(grid_path)
    for k, variant in enumerate(variants, 1):
        variant_seeds = variant.seeds(seeds)
        for j, seed in enumerate(variant_seeds, 1):
            command = variant.command(base, workdir, seed)
            if dry_run:
                echo(shlex.join(command))
                continue
            run_dir = variant.run_dir(workdir, seed)
            which = f"ablate: variant {k} of {len(variants)} ({variant.name})"
            if seed is not None:
                which += f", seed {seed} ({j} of {len(variant_seeds)})"
            if is_finished(variant, run_dir):
                echo(f"{which}: finished, skipping")
                continue
            echo(f"{which}: {'resuming' if os.path.isdir(run_dir) else 'starting'}")
            sys.stdout.flush()  # (before the run's own lines, also when stdout is a pipe)
            result = subprocess.run(command, cwd=REPO)
            if result.returncode != 0:
                what = variant.name if seed is None else f"{variant.name} (seed {seed})"
                raise RunError(f"variant {what!r} failed with exit code {result.returncode} "
                               f"(its message is above): {shlex.join(command)}")
    return variants


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def summarize_run(run_dir: str) -> dict:
    """One run's figures: its last train and validation loss, median tokens/s, ring schedule,
    layout, loss curve, validation loss (and tokens) by position bucket and, where the run
    evaluated passkey retrieval (train.eval_needle_every), its accuracy by needle depth, and where
    it evaluated RULER (train.eval_ruler_every), its latest mean score over tasks and lengths."""
    records = read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    val = [r for r in records if "val/loss" in r]
    info = _read_json(os.path.join(run_dir, "run_info.json"))
    speeds = sorted(r["train/tokens_per_s"] for r in train if "train/tokens_per_s" in r)
    needle = _read_json(os.path.join(run_dir, "needle.json"))
    ruler = _read_json(os.path.join(run_dir, "ruler.json"))  # (the run's latest evaluation)
    return {
        "steps": train[-1]["step"] if train else 0,
        "train_loss": train[-1]["train/loss"] if train else None,
        "val_loss": val[-1]["val/loss"] if val else None,
        "tokens_per_s": speeds[len(speeds) // 2] if speeds else None,
        "schedule_efficiency": info.get("ring_schedule_efficiency"),
        "ring_steps": info.get("ring_steps_run"),
        "layout": info.get("layout"),
        "mesh": info.get("mesh"),
        "train_curve": [(r["step"], r["train/loss"]) for r in train],
        # (bucket starts, loss, tokens); tokens None in runs from before train/steps.py counted them
        "position_loss": (val[-1].get("val/position_bucket_starts"), val[-1].get("val/loss_by_position"),
                          val[-1].get("val/tokens_by_position")) if val else None,
        "passkey": (needle["depths"], [sum(col) / len(col) for col in zip(*needle["accuracy"])])
        if needle.get("accuracy") else None,
        "ruler": ruler.get("mean_score"),
    }


def blind_from(config) -> int | None:
    """The first in-document position some layer of `config` cannot see its document's start
    from (its shortest window or chunk; None where every layer is global)."""
    # lazily: the model's layer types load jax, which the parent process does without until
    # the runs are done
    from longctx.model import layer_types

    types = layer_types.period(config)
    return stats.blind_from([t.attention.get("sliding_window") for t in types],
                                     [t.attention.get("chunk_size") for t in types])


def is_hybrid(config) -> bool:
    # lazily: as blind_from
    from longctx.model import layer_types

    return layer_types.is_hybrid(config)


def _past_loss(run: dict, start: int | None) -> float | None:
    if start is None or not run["position_loss"] or run["position_loss"][2] is None:
        return None
    return stats.loss_from(start, *run["position_loss"])


def _aggregate(name: str, runs: list[dict], blind: int | None) -> dict:
    """A variant's row: means (and standard deviations) over its runs."""
    first = lambda key: next((r[key] for r in runs if r[key] is not None), None)  # noqa: E731
    train_loss, train_std = stats.mean_std([r["train_loss"] for r in runs])
    val_loss, val_std = stats.mean_std([r["val_loss"] for r in runs])
    positions = [r["position_loss"] for r in runs if r["position_loss"] and r["position_loss"][0]]
    starts = positions[0][0] if positions else []
    past_from = stats.first_bucket_from(blind, starts) if blind is not None else None
    past_loss, past_std = stats.mean_std([_past_loss(r, past_from) for r in runs])
    passkeys = [r["passkey"] for r in runs if r["passkey"]]
    ruler, ruler_std = stats.mean_std([r.get("ruler") for r in runs])
    curve = stats.mean_curve([r["train_curve"] for r in runs if r["train_curve"]])
    return {
        "variant": name, "runs": runs, "seeds": sum(r["train_loss"] is not None for r in runs),
        "steps": min(r["steps"] for r in runs),
        "train_loss": train_loss, "train_loss_std": train_std, "val_loss": val_loss, "val_loss_std": val_std,
        "tokens_per_s": stats.mean_std([r["tokens_per_s"] for r in runs])[0],
        "schedule_efficiency": first("schedule_efficiency"), "ring_steps": first("ring_steps"),
        "layout": first("layout"), "blind_from": blind, "past_from": past_from,
        "past_loss": past_loss, "past_loss_std": past_std,
        "train_curve": [(step, mean) for step, mean, _, _ in curve],
        "train_band": [(step, low, high) for step, _, low, high in curve],
        "position_loss": (starts, stats.mean_lists([p[1] for p in positions])) if positions else None,
        "passkey": (passkeys[0][0], stats.mean_lists([p[1] for p in passkeys])) if passkeys else None,
        "ruler": ruler, "ruler_std": ruler_std,
    }


def summarize(variants: list[Variant], workdir: str, seeds: int = 1) -> list[dict]:
    """One row per variant over its `seeds` runs; each row also names the variants within its
    validation loss's spread, and gives the first variant's loss on the tokens past its window."""
    rows = [_aggregate(v.name, [summarize_run(v.run_dir(workdir, s)) for s in v.seeds(seeds)],
                       blind_from(v.config)) for v in variants]
    close = stats.within_spread([r["variant"] for r in rows], [r["val_loss"] for r in rows],
                                [r["val_loss_std"] for r in rows])
    for r, v in zip(rows, variants):
        if is_hybrid(v.config):  # run_info's ring schedule is attention.*'s, not each type's
            r["schedule_efficiency"] = r["ring_steps"] = None
        r["within_spread"] = close[r["variant"]]
        r["reference_past_loss"] = stats.mean_std([_past_loss(run, r["past_from"]) for run in rows[0]["runs"]])[0]
    return rows


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _spread_cell(mean, std, fmt: str) -> str:
    return _cell(mean, fmt) if std is None else f"{mean:{fmt}} ± {std:{fmt}}"


def markdown_table(rows: list[dict]) -> str:
    """The table, and under it what its spread and comparison columns mean. Optional columns:
    passkey by depth and the RULER average where a run evaluated them (the grid sets
    train.eval_needle_every, train.eval_ruler_every), K/V bytes where the caller priced them
    (row["kv_bytes"], scripts/ablate.py)."""
    reference = rows[0]["variant"] if rows else ""
    passkey = next((r["passkey"] for r in rows if r.get("passkey")), None)
    ruler = any(r.get("ruler") is not None for r in rows)
    priced = any(r.get("kv_bytes") is not None for r in rows)
    header = ["variant", "steps", "seeds", "train loss", "val loss", "val loss within the spread of",
              "first position past the window", "val loss there", f"{reference} there"]
    if passkey:
        header.append("passkey at depth " + " / ".join(f"{d:.0%}" for d in passkey[0]))
    if ruler:
        header.append("RULER average")
    header += ["tokens/s", "layout", "ring schedule efficiency", "ring steps"]
    if priced:
        header.append("K/V bytes per step per device")
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * 4 + "---|" + "---:|" * 3
             + "---:|" * bool(passkey) + "---:|" * ruler + "---:|---|---:|---:|" + "---:|" * priced]
    for r in rows:
        cells = [r["variant"], str(r["steps"]), str(r["seeds"]),
                 _spread_cell(r["train_loss"], r["train_loss_std"], ".4f"),
                 _spread_cell(r["val_loss"], r["val_loss_std"], ".4f"),
                 ", ".join(r.get("within_spread", [])) or "–", _cell(r["past_from"], "d"),
                 _spread_cell(r["past_loss"], r["past_loss_std"], ".4f"),
                 _cell(r.get("reference_past_loss") if r["past_from"] is not None else None, ".4f")]
        if passkey:
            cells.append(" / ".join(f"{a:.2f}" for a in r["passkey"][1]) if r.get("passkey") else "–")
        if ruler:
            cells.append(_spread_cell(r.get("ruler"), r.get("ruler_std"), ".2f"))
        cells += [_cell(r["tokens_per_s"], ".0f"), r["layout"] or "–", _cell(r["schedule_efficiency"], ".3f"),
                  _cell(r["ring_steps"], "d")]
        if priced:
            cells.append(_cell(r.get("kv_bytes"), ",d"))
        lines.append("| " + " | ".join(cells) + " |")
    seeds = max((r["seeds"] for r in rows), default=0)
    notes = [f"Losses are the mean over {seeds} seeds ± their sample standard deviation (n - 1); "
             "a variant is within the spread of another when their mean validation losses differ "
             "by less than the larger of the two standard deviations (the run does not tell them "
             "apart)." if seeds > 1 else "One seed per variant: no spread (scripts/ablate.py --seeds N).",
             "\"First position past the window\": the first position bucket ([0, 1), [1, 3), [3, 7), "
             "...) whose tokens all lie further into their document than the variant's shortest "
             f"window (or chunk) reaches; \"val loss there\" is the validation loss on those tokens, "
             f"\"{reference} there\" the first variant's on the same tokens. Ring schedule: the run's "
             "(run_info.json), of attention.*; \"–\" for a hybrid model, whose types each have their own."]
    if ruler:
        notes.append("RULER average: the mean score over the tasks and lengths of each run's last RULER "
                     "evaluation (train.eval_ruler_every: its ruler.json, docs/ruler.md), then over the seeds "
                     "that ran it; \"–\" where none did.")
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n"


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
            line, = ax.plot(steps, losses, label=r["variant"])
            if r["seeds"] > 1:  # the seeds' range around their mean
                _, low, high = zip(*r["train_band"])
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    seeded = any(r["seeds"] > 1 for r in rows)
    title = "Training loss by variant" + (" (mean and range over seeds)" if seeded else "")
    ax.set(xlabel="step", ylabel="train loss", title=title)
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
    ax.set(xlabel="position in document (bucket start + 1, log scale)", ylabel="validation loss (mean over seeds)",
           title="Validation loss by token position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["position"], dpi=120)
    plt.close(fig)
    return paths
