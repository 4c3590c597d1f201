"""RULER's synthetic tasks scored by greedy answers, on the model as it trains or as saved.

The samples come from longctx.evals.ruler_tasks. A sample is scored as RULER scores it, the
fraction of its expected strings found in the model's answer (`string_match_all`, case
folded), averaged per task and length (RULER reports it x 100; here it stays in [0, 1]).

The answer is found without a decoding loop: one forward pass over the prompt and the task's
answer in RULER's format gives the argmax at every answer position given the true answer's
earlier tokens (teacher forcing). Greedy decoding produces those tokens exactly as far as each
argmax is the answer's next token, so what greedy decoding is known to say is the answer's tokens
up to the first argmax that differs; that text is what the score reads. It is a lower bound on
RULER's score of the same greedy answer (the model could find more strings after departing from
the format), equal to it for an answer in the format given: values in the order they appear,
keys in the order asked, words listed as the prefix starts them. tests/evals/test_ruler.py checks
it against a token-by-token greedy decode.

Samples shorter than data.seq_len are packed several to a row as separate documents (segment
ids, positions from 0) when the model masks documents (attention.use_segment_ids), so a grid of
short lengths costs a few forward passes; each runs sharded over sp as in training
(longctx.evals.inference).

During training, `RULER_EVALUATOR` (handed to `train_and_evaluate` by scripts/train.py when
train.eval_ruler_every > 0) runs a small grid every that many steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Sequence

import jax
import numpy as np

from longctx.errors import ConfigError
from longctx.evals import inference
from longctx.evals import needle as needle_lib
from longctx.evals import ruler_tasks
from longctx.train import hooks

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def string_match_all(prediction: str, expected: Sequence[str]) -> float:
    """RULER's score of one answer: the fraction of the expected strings in it, case folded."""
    text = prediction.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


@dataclasses.dataclass(frozen=True)
class Found:
    """What teacher forcing says of one sample's answer."""

    argmax: np.ndarray  # int32 [answer_len]: the argmax at each answer position
    agreed: int  # answer tokens greedy decoding reproduces (the first `agreed` argmaxes match)


def pack(lengths: Sequence[int], seq_len: int, pack_documents: bool) -> list[list[int]]:
    """Rows of sample indices: first fit in decreasing length, one per row without packing."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > seq_len:
            raise ValueError(f"a sample of {lengths[i]} tokens is longer than data.seq_len={seq_len}.")
        for r, free in enumerate(room):
            if pack_documents and lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(seq_len - lengths[i])
    return rows


def teacher_forced(runner, samples: Sequence[ruler_tasks.Sample]) -> list[Found]:
    """The argmax at each sample's answer positions given the true prefix, batched: rows of the
    run's batch size, short samples packed as documents; one compile (a fixed width of asked
    positions) for the whole list."""
    config = runner.config
    seq_len, batch_size = config.data.seq_len, config.data.global_batch_size
    rows = pack([len(s.tokens) for s in samples], seq_len, bool(config.attention.use_segment_ids))
    width = max(sum(samples[i].answer_len for i in row) for row in rows)
    found: list[Found | None] = [None] * len(samples)
    for start in range(0, len(rows), batch_size):
        group = rows[start:start + batch_size]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        segments = np.zeros_like(tokens)
        positions = np.zeros_like(tokens)
        where = np.zeros((batch_size, width), np.int32)
        for r, row in enumerate(group):
            at, asked = 0, 0
            for doc, i in enumerate(row, start=1):
                s = samples[i]
                n, k = len(s.tokens), s.answer_len
                tokens[r, at:at + n], segments[r, at:at + n], positions[r, at:at + n] = s.tokens, doc, np.arange(n)
                # The logits at position t predict token t+1: the answer's k tokens are predicted
                # from the k positions before the last one.
                where[r, asked:asked + k] = at + np.arange(n - k - 1, n - 1)
                at, asked = at + n, asked + k
        argmax = runner.logits_at({"tokens": tokens, "segment_ids": segments, "positions": positions},
                                  where).argmax(-1)
        for r, row in enumerate(group):
            asked = 0
            for i in row:
                k = samples[i].answer_len
                got = argmax[r, asked:asked + k].astype(np.int32)
                wrong = np.nonzero(got != samples[i].answer)[0]
                found[i] = Found(got, int(wrong[0]) if len(wrong) else k)
                asked += k
    return found


def greedy_text(tokenizer, sample: ruler_tasks.Sample, found: Found) -> str:
    """The part of the greedy answer teacher forcing vouches for."""
    return tokenizer.decode(sample.answer[:found.agreed])


def make_samples(tokenizer, documents, tasks: Sequence[str], lengths: Sequence[int],
                 depths: Sequence[float], samples: int, seed: int):
    """(samples, cells that do not fit {(task, length): why}): `samples` per (task, length,
    depth) (cwe and fwe, which have no depth, `samples` x len(depths) per length, so every cell
    averages as many). Seeded per (seed, task, length, sample): the same samples for the same
    data, whatever else is asked."""
    unknown = [t for t in tasks if t not in ruler_tasks.TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task {unknown[0]!r}; the tasks are {', '.join(ruler_tasks.TASKS)}.")
    needs_documents = any(ruler_tasks.TASKS[t].uses_documents for t in tasks)
    hay = ruler_tasks.Haystacks(tokenizer, documents if needs_documents else None, limit=4 * max(lengths))
    out, skipped = [], {}
    for name in tasks:
        task = ruler_tasks.TASKS[name]
        for length in lengths:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode()), length])
            cell = []
            try:
                for k in range(samples * len(depths)):
                    depth = depths[k % len(depths)] if task.uses_depth else None
                    cell.append(ruler_tasks.generate(task, hay, length, depth, rng))
            except ValueError as e:
                skipped[(name, length)] = str(e)
                continue
            out += cell
    return out, skipped


def evaluate(runner, tokenizer, documents, *, tasks: Sequence[str], lengths: Sequence[int],
             depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 2, seed: int = 0,
             refuse_if_none_fit: bool = False) -> dict:
    """Score per (task, length) and per (task, length, depth), with what was used. Where no task
    fits at any length, `refuse_if_none_fit` raises the ConfigError that says so (before anything
    compiles); else every cell is reported as not run."""
    seq_len = runner.config.data.seq_len
    lengths = sorted(lengths)
    if max(lengths) > seq_len:
        raise ValueError(f"RULER length {max(lengths)} is longer than data.seq_len={seq_len}.")
    made, skipped = make_samples(tokenizer, documents, tasks, lengths, depths, samples, seed)
    if not made and refuse_if_none_fit:
        why = skipped[(tasks[0], lengths[-1])].rstrip(".")
        raise ConfigError(f"no RULER task of {', '.join(tasks)} fits in {', '.join(map(str, lengths))} tokens: "
                          f"{why}; ask for longer --lengths (up to the model's sequence length, or "
                          "--seq-len) or other --tasks.")
    found = teacher_forced(runner, made) if made else []
    score = {(t, n): [] for t in tasks for n in lengths}
    by_depth = {(t, n, d): [] for t in tasks for n in lengths for d in depths}
    for s, f in zip(made, found):
        value = string_match_all(greedy_text(tokenizer, s, f), s.expected)
        score[(s.task, s.length)].append(value)
        if s.depth is not None:
            by_depth[(s.task, s.length, s.depth)].append(value)
    mean = lambda xs: round(float(np.mean(xs)), 4) if xs else None  # noqa: E731
    table = [[mean(score[(t, n)]) for n in lengths] for t in tasks]
    run = [v for row in table for v in row if v is not None]
    return {
        "tasks": list(tasks), "lengths": [int(n) for n in lengths], "depths": [float(d) for d in depths],
        "samples_per_cell": samples * len(depths), "seed": seed,
        "score": table, "mean_score": round(float(np.mean(run)), 4) if run else None,
        "score_by_depth": {t: [[mean(by_depth[(t, n, d)]) for d in depths] for n in lengths]
                           for t in tasks if ruler_tasks.TASKS[t].uses_depth},
        "not_run": {f"{t}@{n}": why for (t, n), why in skipped.items()},
        "haystack": {t: ruler_tasks.TASKS[t].haystack for t in tasks},
        "tokenizer_name": tokenizer.name, "scoring": "teacher-forced greedy, string_match_all",
        "layout": runner.layout, "mesh": {k: int(v) for k, v in runner.mesh.shape.items()},
        "attention_impl": runner.config.attention.impl,
    }


def write_results(result: dict, directory: str, title: str = "RULER", name: str = "ruler") -> tuple[str, str]:
    """`<name>.json` and the task x length heatmap `<name>.png` in `directory` (cells not run grey)."""
    import matplotlib  # lazily: plotting only where results are written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    json_path, png_path = os.path.join(directory, name + ".json"), os.path.join(directory, name + ".png")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    score = np.array([[np.nan if v is None else v for v in row] for row in result["score"]], float)
    fig, ax = plt.subplots(figsize=(2.5 + 0.8 * score.shape[1], 1.0 + 0.38 * score.shape[0]))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(score), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(result["lengths"])), [f"{n:,}" for n in result["lengths"]], fontsize=7)
    ax.set_yticks(range(len(result["tasks"])), result["tasks"], fontsize=7)
    ax.set_xlabel("length (tokens)")
    for (i, j), value in np.ndenumerate(score):
        ax.text(j, i, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=6)
    mean = result["mean_score"]
    ax.set_title(f"{title}: mean {'-' if mean is None else f'{mean:.2f}'}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04, label="score (string match)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


# ----------------------------------------------------------------------------- during training


class TrainingEvaluator:
    """`train.eval_ruler_every`: TASKS at the passkey evaluator's lengths (needle.default_lengths),
    one sample per (task, length, depth) at 3 depths, on the parameters being trained with the
    run's mesh, layout and jitted forward. Haystacks from the run's validation documents. Writes
    ruler.json / ruler.png in the workdir (the latest evaluation) and returns the scores to log:
    `score` (the mean), `<task>` and `<task>/<length>`."""

    TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "fwe")
    DEPTHS = (0.0, 0.5, 1.0)

    def __init__(self, run: hooks.RunContext):
        self.workdir = run.workdir
        self.runner = inference.make_runner(run.config, lambda abstract, shardings: None, mesh=run.mesh,
                                            setup=run.setup, layout=run.layout)
        self.tokenizer, documents = needle_lib.validation_documents(run.config, run.data_dir)
        seq_len = run.config.data.seq_len
        self.lengths = needle_lib.default_lengths(seq_len, shortest=min(256, seq_len))
        self.documents = list(needle_lib._take_tokens((np.asarray(d) for d in documents), 4 * seq_len))

    def __call__(self, params, step: int) -> dict:
        runner = dataclasses.replace(self.runner, params=params)
        result = evaluate(runner, self.tokenizer, self.documents, tasks=self.TASKS, lengths=self.lengths,
                          depths=self.DEPTHS, samples=1)
        result["step"] = step
        if jax.process_index() == 0:
            write_results(result, self.workdir, title=f"RULER at step {step}")
        metrics = {"score": result["mean_score"]}
        for task, row in zip(result["tasks"], result["score"]):
            run = [v for v in row if v is not None]
            if run:
                metrics[task] = round(float(np.mean(run)), 4)
            metrics.update({f"{task}/{n}": v for n, v in zip(result["lengths"], row) if v is not None})
        return metrics


# What scripts/train.py hands to train_and_evaluate: the loop builds a TrainingEvaluator at
# start-up and runs it every train.eval_ruler_every steps, its metrics under ruler/.
RULER_EVALUATOR = hooks.Evaluator(
    every_key="eval_ruler_every", prefix="ruler", build=TrainingEvaluator,
    log_line=lambda found: "RULER score=" + ("-" if found["score"] is None else f"{found['score']:.3f}"))
