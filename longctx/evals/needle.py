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

`synthetic_rows` is a small retrieval task over token ids (no tokenizer) with which a tiny model
learns retrieval in a few hundred CPU steps: the needle is a marker and a value token, the
question a marker whose next token is the value. It can place the needle on another ring shard
than the question (so only the ring carries it across devices), and in another document
(segment) than the question (so the document mask must hide it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from longctx.parallel import layout as layout_lib

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
    import matplotlib

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


# ----------------------------------------------------------------------------- synthetic task

NEEDLE_MARK, QUESTION_MARK, FIRST_VALUE = 1, 2, 3


def _shard_of_position(layout: str, seq_len: int, sp: int) -> np.ndarray:
    shard = np.empty(seq_len, np.int32)
    for d, positions in enumerate(layout_lib.shard_positions(layout, seq_len, sp)):
        shard[positions] = d
    return shard


def synthetic_rows(rng: np.random.Generator, batch: int, seq_len: int, vocab_size: int, *,
                   num_values: int, sp: int, layout: str, split_documents: bool = False) -> dict:
    """Natural-order rows of the retrieval task; `answers` [batch] is the value to retrieve.

    Tokens: NEEDLE_MARK, QUESTION_MARK, `num_values` value ids, the rest filler. Every row is
    filler with NEEDLE_MARK v at a random place on a ring shard other than the question's, and
    QUESTION_MARK v as its last two tokens; the loss is only on predicting v after QUESTION_MARK.
    With `split_documents` the needle ends one document and the question is in the next (segment
    ids 1 and 2, positions restarting), so a model that respects the document mask cannot see it.
    """
    first_filler = FIRST_VALUE + num_values
    if vocab_size <= first_filler:
        raise ValueError(f"vocab_size={vocab_size} leaves no filler tokens after {num_values} values.")
    shard = _shard_of_position(layout, seq_len, sp)
    question_at = seq_len - 2
    # Needle marker positions p whose marker and value (p + 1) both sit on other shards than the
    # question, with filler between the needle and the question (room for a document boundary).
    candidates = np.arange(1, seq_len - 4)
    allowed = candidates[(shard[candidates] != shard[question_at]) & (shard[candidates + 1] != shard[question_at])]
    tokens = rng.integers(first_filler, vocab_size, (batch, seq_len)).astype(np.int32)
    answers = rng.integers(FIRST_VALUE, first_filler, batch).astype(np.int32)
    segment_ids = np.ones((batch, seq_len), np.int32)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1))
    for b in range(batch):
        p = int(rng.choice(allowed))
        tokens[b, p], tokens[b, p + 1] = NEEDLE_MARK, answers[b]
        tokens[b, question_at], tokens[b, question_at + 1] = QUESTION_MARK, answers[b]
        if split_documents:
            cut = int(rng.integers(p + 2, question_at))  # the question's document starts here
            segment_ids[b, cut:] = 2
            positions[b, cut:] = np.arange(seq_len - cut)
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    loss_mask = np.zeros_like(tokens)
    loss_mask[:, question_at] = 1
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "targets": targets,
            "loss_mask": loss_mask, "answers": answers, "question_at": question_at}


def synthetic_accuracy(runner, rows: dict) -> float:
    """Share of rows whose greedy prediction after QUESTION_MARK is the needle's value."""
    where = np.full((len(rows["answers"]), 1), rows["question_at"], np.int32)
    predicted = runner.logits_at(rows, where)[:, 0].argmax(-1)
    return float(np.mean(predicted == rows["answers"]))


def synthetic_grid(runner, lengths: Sequence[int], depths: Sequence[float], rows_per_cell: int = 32,
                   seed: int = 2) -> dict:
    """Accuracy per (haystack length, needle depth) on the synthetic task, in `evaluate`'s format
    (so `write_results` draws it). A haystack of n tokens is one document at the end of the row
    (padding before it), its question at the row's end as in training; the needle's marker sits
    at depth d of the n - 5 places before the question. `cross_shard` gives, per cell, the share
    of rows whose needle is on another ring shard than the question."""
    seq_len, vocab = runner.config.data.seq_len, runner.config.model.vocab_size
    shard = _shard_of_position(runner.layout, seq_len, runner.sp)
    rng = np.random.default_rng(seed)
    accuracy = np.zeros((len(lengths), len(depths)))
    cross = np.zeros_like(accuracy)
    for i, n in enumerate(lengths):
        for j, depth in enumerate(depths):
            rows = synthetic_rows(rng, rows_per_cell, seq_len, vocab, num_values=SYNTHETIC_NUM_VALUES,
                                  sp=runner.sp, layout=runner.layout)
            start = seq_len - n
            p = start + 1 + int(round(depth * (n - 6)))
            tokens, filler = rows["tokens"], FIRST_VALUE + SYNTHETIC_NUM_VALUES  # (a filler id)
            old = np.argmax(tokens == NEEDLE_MARK, axis=1)  # the row's own needle, moved to p
            tokens[np.arange(rows_per_cell), old] = tokens[np.arange(rows_per_cell), old + 1] = filler
            tokens[:, p], tokens[:, p + 1] = NEEDLE_MARK, rows["answers"]
            rows["segment_ids"][:, :start] = 0  # padding before the haystack
            rows["positions"][:, start:] = np.arange(n)
            accuracy[i, j] = synthetic_accuracy(runner, rows)
            cross[i, j] = float(shard[p] != shard[rows["question_at"]] and shard[p + 1] != shard[rows["question_at"]])
    return {"lengths": list(map(int, lengths)), "depths": [float(d) for d in depths],
            "samples_per_cell": rows_per_cell, "seed": seed, "accuracy": accuracy.round(4).tolist(),
            "mean_accuracy": float(accuracy.mean()), "cross_shard": cross.tolist(),
            "chance": 1.0 / SYNTHETIC_NUM_VALUES, "layout": runner.layout,
            "mesh": {k: int(v) for k, v in runner.mesh.shape.items()},
            "attention_impl": runner.config.attention.impl}


# The tiny model and run of the synthetic retrieval check (tests/test_needle.py and
# benchmarks/bench_needle.py apply these to configs/base.py:tiny): 128-token rows over the 1x2x4 mesh.
SYNTHETIC_NUM_VALUES = 10
SYNTHETIC_OVERRIDES = {
    "mesh.dp": 1, "mesh.fsdp": 2, "mesh.sp": 4,
    "model.vocab_size": 64, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
    "model.num_kv_heads": 2, "model.head_dim": 16, "model.mlp_dim": 128, "model.dtype": "float32",
    "model.remat_policy": "none",
    "attention.impl": "xla", "attention.layout": "zigzag", "attention.block_size": 16,
    "data.seq_len": 128, "data.global_batch_size": 16,
    "optimizer.learning_rate": 6e-3, "optimizer.warmup_steps": 20, "optimizer.weight_decay": 0.0,
    "train.num_steps": 200, "train.loss_chunk_size": 32,
}


def train_synthetic(config, seed: int):
    """Trains with the real train_step on synthetic_rows (data and init seeded by `seed`);
    returns a Runner holding the trained parameters."""
    import jax

    from longctx.evals import inference
    from longctx.parallel import mesh as mesh_lib
    from longctx.train import loop as train

    mesh = mesh_lib.make_mesh(config.mesh)
    layout, sp, d = config.attention.layout, int(mesh.shape[mesh_lib.SP]), config.data
    perm = layout_lib.permutation(layout, d.seq_len, sp)
    rng = np.random.default_rng(seed)
    with jax.set_mesh(mesh):
        setup = train.make_setup(config, mesh, layout)
        state = setup.init(jax.random.PRNGKey(seed))
        train_step, _ = train.jit_steps(config, setup)
        for _ in range(config.train.num_steps):
            rows = synthetic_rows(rng, d.global_batch_size, d.seq_len, config.model.vocab_size,
                                  num_values=SYNTHETIC_NUM_VALUES, sp=sp, layout=layout)
            state, _ = train_step(state, {k: jax.device_put(rows[k][:, perm], setup.batch_sharding)
                                          for k in train.BATCH_KEYS})
            # One step in flight at a time: with many queued on virtual CPU devices, XLA:CPU's
            # all-gathers were seen to deadlock (5 of 8 devices at the rendezvous, abort at 40 s).
            jax.block_until_ready(state)
    return inference.make_runner(config, lambda *_: state.params, mesh=mesh, setup=setup, layout=layout)


def synthetic_report(runner, rows: int = 128, seed: int = 1) -> dict:
    """Accuracy on held-out rows: the needle on another shard in the same document; the same in
    the previous document; and those again with the document mask off (use_segment_ids=False)."""
    from longctx.evals import inference

    config = runner.config
    kw = dict(batch=rows, seq_len=config.data.seq_len, vocab_size=config.model.vocab_size,
              num_values=SYNTHETIC_NUM_VALUES, sp=runner.sp, layout=runner.layout)
    held_out = np.random.default_rng(seed)
    same_document = synthetic_rows(held_out, **kw)
    other_document = synthetic_rows(held_out, **kw, split_documents=True)
    unmasked = config.copy_and_resolve_references()
    unmasked.attention.use_segment_ids = False
    unmasked_runner = inference.make_runner(unmasked, lambda *_: runner.params, mesh=runner.mesh,
                                            layout=runner.layout)
    return {"cross_shard": synthetic_accuracy(runner, same_document),
            "cross_document": synthetic_accuracy(runner, other_document),
            "cross_document_without_mask": synthetic_accuracy(unmasked_runner, other_document),
            "chance": 1.0 / SYNTHETIC_NUM_VALUES, "held_out_rows": rows}


# ----------------------------------------------------------------------------- runs


def validation_documents(config, data_dir: str):
    """(tokenizer, the validation split's documents) of a run's dataset."""
    from longctx import data as data_lib
    from longctx.data import pipeline

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

    def __init__(self, config, setup, mesh, layout: str, data_dir: str, workdir: str):
        from longctx.evals import inference

        self.workdir = workdir
        self.runner = inference.make_runner(config, lambda abstract, shardings: None, mesh=mesh,
                                            setup=setup, layout=layout)
        self.tokenizer, documents = validation_documents(config, data_dir)
        self.documents = [np.asarray(d) for d in _take_tokens(documents, 4 * config.data.seq_len)]

    def __call__(self, params, step: int) -> dict:
        import jax

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
