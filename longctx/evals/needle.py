"""Passkey retrieval ("needle in a haystack"): does a model use its long context?

A haystack is validation text with a passkey sentence (the needle) inserted at a depth of 0-100%
of the filler, followed by a question whose answer is the passkey:

  BOS  filler[:i]  " The pass key is 40917. Remember it. 40917 is the pass key."  filler[i:]
       " What is the pass key? The pass key is"  " 40917"

Each haystack is one document of `length` tokens (<= data.seq_len; shorter ones are padded with
segment 0, which attends to nothing real). It runs through the model sharded over sp exactly as
in training (`longctx.evals.inference`: the run's layout, mesh and attention), and is scored by exact
match of greedy decoding: the answer is right when the argmax at every answer position, given
the true prefix, is the passkey's next token; that is the condition for greedy generation to
produce the passkey, so no decoding loop is needed. The result is an accuracy per (length,
depth) cell, written as `needle.json` and a heatmap `needle.png`.

During training, `PASSKEY_EVALUATOR` (handed to `train_and_evaluate` by scripts/train.py when
train.eval_needle_every > 0) runs a small grid every that many steps. The synthetic retrieval
task over token ids that a tiny model learns on CPU lives with its benchmark
(benchmarks/needle_synthetic.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import jax
import numpy as np

from longctx import data as data_lib
from longctx.data import pipeline
from longctx.evals import inference
from longctx.train import hooks

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DEFAULT_DEPTHS = tuple(np.round(np.linspace(0.0, 1.0, 11), 2))
PASSKEY_DIGITS = 5


@dataclasses.dataclass(frozen=True)
class Haystack:
    tokens: np.ndarray  # int32 [n], natural order, one document
    answer: np.ndarray  # the passkey's token ids, the last len(answer) tokens of `tokens`
    length: int
    depth: float


def default_lengths(seq_len: int, shortest: int, count: int = 4) -> list[int]:
    """Up to `count` lengths doubling up to seq_len (seq_len/8, /4, /2, seq_len), none below
    `shortest`."""
    return sorted({seq_len >> i for i in range(count) if seq_len >> i >= shortest} | {seq_len})


def passkey_overhead(tokenizer) -> int:
    """Tokens a haystack spends on BOS, needle, question and answer (a 5-digit key)."""
    key = "0" * PASSKEY_DIGITS
    return 1 + sum(len(tokenizer.encode(text.encode())) for text in
                   (NEEDLE.format(key=key), QUESTION, " " + key))


def passkey_haystack(tokenizer, filler: np.ndarray, length: int, depth: float, key: str,
                     offset: int = 0) -> Haystack:
    """One haystack of exactly `length` tokens: filler from `filler[offset:]` (wrapping around)."""
    needle = tokenizer.encode(NEEDLE.format(key=key).encode())
    question = tokenizer.encode(QUESTION.encode())
    answer = tokenizer.encode((" " + key).encode())
    budget = length - 1 - len(needle) - len(question) - len(answer)
    if budget < 0:
        raise ValueError(f"a haystack of {length} tokens cannot hold the needle, question and answer "
                         f"({length - budget - 1} tokens).")
    hay = np.take(filler, np.arange(offset, offset + budget), mode="wrap")
    at = int(round(depth * budget))
    tokens = np.concatenate([[tokenizer.bos_id], hay[:at], needle, hay[at:], question, answer]).astype(np.int32)
    return Haystack(tokens, np.asarray(answer, np.int32), length, float(depth))


def filler_tokens(documents, tokenizer, limit: int) -> np.ndarray:
    """Validation documents' ids without their BOS/EOS, joined, up to `limit` tokens; documents
    that mention a pass key are left out."""
    parts, total = [], 0
    for doc in documents:
        ids = np.asarray(doc, np.int32)
        ids = ids[(ids != tokenizer.bos_id) & (ids != tokenizer.eos_id) & (ids != tokenizer.pad_id)]
        if "pass key" in tokenizer.decode(ids):
            continue  # it would plant a second needle (a dataset with passkey training documents)
        parts.append(ids)
        total += len(ids)
        if total >= limit:
            break
    if not total:
        raise ValueError("the validation split holds no text without a pass key to build haystacks from.")
    return np.concatenate(parts)[:limit]


def retokenized(documents, source, target):
    """Documents stored as `source`'s ids, as `target`'s (through their text): a dataset prepared
    with another tokenizer than the model's still gives it filler text."""
    for doc in documents:
        yield target.encode_document(source.decode(np.asarray(doc)).encode())


def answer_correct(runner, haystacks: Sequence[Haystack]) -> np.ndarray:
    """bool [len(haystacks)]: greedy exact match of each passkey, batched by the run's batch size."""
    batch_size = runner.config.data.global_batch_size
    seq_len = runner.config.data.seq_len
    width = max(len(h.answer) for h in haystacks)
    out = []
    for start in range(0, len(haystacks), batch_size):
        group = list(haystacks[start:start + batch_size])
        real = len(group)
        group += [group[-1]] * (batch_size - real)  # a full batch; the copies are not scored
        tokens = np.zeros((batch_size, seq_len), np.int32)
        segments = np.zeros((batch_size, seq_len), np.int32)
        positions = np.zeros((batch_size, seq_len), np.int32)
        where = np.zeros((batch_size, width), np.int32)
        answers = np.full((batch_size, width), -1, np.int32)
        for i, h in enumerate(group):
            n, k = len(h.tokens), len(h.answer)
            tokens[i, :n], segments[i, :n], positions[i, :n] = h.tokens, 1, np.arange(n)
            # The logits at position t predict token t+1: the answer's tokens are predicted
            # from the k positions before the last one.
            where[i, :k] = np.arange(n - k - 1, n - 1)
            where[i, k:] = n - 2
            answers[i, :k] = h.answer
        predicted = runner.logits_at({"tokens": tokens, "segment_ids": segments, "positions": positions},
                                     where).argmax(-1)
        correct = np.all((predicted == answers) | (answers < 0), axis=1)
        out.extend(correct[:real].tolist())
    return np.asarray(out, bool)


def evaluate(runner, tokenizer, documents, *, lengths: Sequence[int] | None = None,
             depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 4, seed: int = 0) -> dict:
    """Accuracy per (length, depth) cell over `samples` passkeys each (seeded: the same haystacks
    for the same data, lengths, depths and seed)."""
    seq_len = runner.config.data.seq_len
    # Filler at least as long as the rest, so depth means something.
    lengths = sorted(lengths or default_lengths(seq_len, shortest=2 * passkey_overhead(tokenizer)))
    if max(lengths) > seq_len:
        raise ValueError(f"needle length {max(lengths)} is longer than data.seq_len={seq_len}.")
    filler = filler_tokens(documents, tokenizer, limit=4 * seq_len)
    rng = np.random.default_rng(seed)
    cells, haystacks = [], []
    for length in lengths:
        for depth in depths:
            for _ in range(samples):
                key = "".join(str(d) for d in rng.integers(0, 10, PASSKEY_DIGITS))
                offset = int(rng.integers(0, len(filler)))
                haystacks.append(passkey_haystack(tokenizer, filler, length, depth, key, offset))
                cells.append((length, depth))
    correct = answer_correct(runner, haystacks)
    accuracy = np.zeros((len(lengths), len(depths)))
    for (length, depth), ok in zip(cells, correct):
        accuracy[lengths.index(length), list(depths).index(depth)] += ok / samples
    return {"lengths": list(map(int, lengths)), "depths": [float(d) for d in depths],
            "samples_per_cell": samples, "passkey_digits": PASSKEY_DIGITS, "seed": seed,
            "accuracy": accuracy.round(4).tolist(), "mean_accuracy": float(correct.mean()),
            "layout": runner.layout, "mesh": {k: int(v) for k, v in runner.mesh.shape.items()},
            "attention_impl": runner.config.attention.impl}


def write_results(result: dict, directory: str, title: str = "passkey retrieval") -> tuple[str, str]:
    """`needle.json` and the length x depth heatmap `needle.png` in `directory`."""
    import matplotlib  # lazily: plotting only where results are written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    json_path, png_path = os.path.join(directory, "needle.json"), os.path.join(directory, "needle.png")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    accuracy = np.asarray(result["accuracy"])
    fig, ax = plt.subplots(figsize=(1.5 + 0.55 * accuracy.shape[1], 1.2 + 0.5 * accuracy.shape[0]))
    image = ax.imshow(accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    ax.set_xticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]], fontsize=7)
    ax.set_yticks(range(len(result["lengths"])), [f"{n:,}" for n in result["lengths"]], fontsize=7)
    ax.set_xlabel("needle depth in the haystack")
    ax.set_ylabel("haystack length (tokens)")
    for (i, j), value in np.ndenumerate(accuracy):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6)
    ax.set_title(f"{title}: mean {result['mean_accuracy']:.2f}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04, label="exact match")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path


# ----------------------------------------------------------------------------- runs


def validation_documents(config, data_dir: str):
    """(tokenizer, the validation split's documents) of a run's dataset."""
    meta = data_lib.load_metadata(data_dir)
    tokenizer = data_lib.load_tokenizer(meta["tokenizer"], data_dir)
    source = pipeline.TokenSource(data_dir, "validation", meta)
    return tokenizer, (source[i] for i in range(len(source)))


class TrainingEvaluator:
    """`train.eval_needle_every`: passkey retrieval on the parameters being trained, with the run's
    mesh, layout and jitted forward; a smaller grid than scripts/eval_needle.py (5 depths, one
    passkey per cell) so that it costs a few forward passes. Writes needle.json / needle.png in
    the workdir (the latest evaluation) and returns the metrics to log."""

    DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

    def __init__(self, run: hooks.RunContext):
        self.workdir = run.workdir
        self.runner = inference.make_runner(run.config, lambda abstract, shardings: None, mesh=run.mesh,
                                            setup=run.setup, layout=run.layout)
        self.tokenizer, documents = validation_documents(run.config, run.data_dir)
        self.documents = [np.asarray(d) for d in _take_tokens(documents, 4 * run.config.data.seq_len)]

    def __call__(self, params, step: int) -> dict:
        runner = dataclasses.replace(self.runner, params=params)
        result = evaluate(runner, self.tokenizer, self.documents, depths=self.DEPTHS, samples=1)
        result["step"] = step
        if jax.process_index() == 0:
            write_results(result, self.workdir, title=f"passkey retrieval at step {step}")
        return {"accuracy": result["mean_accuracy"], "lengths": result["lengths"],
                "accuracy_by_length": [float(np.mean(row)) for row in result["accuracy"]]}


def _take_tokens(documents, limit: int):
    total = 0
    for doc in documents:
        yield doc
        total += len(doc)
        if total >= limit:
            return


# What scripts/train.py hands to train_and_evaluate: the loop builds a TrainingEvaluator at
# start-up and runs it every train.eval_needle_every steps, its metrics under needle/.
PASSKEY_EVALUATOR = hooks.Evaluator(
    every_key="eval_needle_every", prefix="needle", build=TrainingEvaluator,
    log_line=lambda found: f"passkey retrieval accuracy={found['accuracy']:.3f}")
