"""The synthetic retrieval task of the needle benchmark (benchmarks/bench_needle.py) and its test
(tests/evals/test_needle.py): a small retrieval task over token ids (no tokenizer) with which a tiny
model learns retrieval in a few hundred CPU steps, trained with the library's real train_step.

The needle is a marker and a value token, the question a marker whose next token is the value.
It can place the needle on another ring shard than the question (so only the ring carries it
across devices), and in another document (segment) than the question (so the document mask must
hide it). Results come in `longctx.evals.needle.evaluate`'s format, so its `write_results` draws
them. Tests import it with benchmarks/ on sys.path.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from longctx.evals import inference
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from longctx.train import state as train_state
from longctx.train import steps as train_steps

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
    (so `longctx.evals.needle.write_results` draws it). A haystack of n tokens is one document at the end of the row
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


# The tiny model and run of the synthetic retrieval check (tests/evals/test_needle.py and
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


def train_synthetic(config, seed: int, compiler_options: dict | None = None, make_rows=None):
    """Trains with the real train_step on synthetic_rows (data and init seeded by `seed`);
    returns a Runner holding the trained parameters. `compiler_options` go to XLA for the train
    step (the tests' LLVM level 0 compiles faster but runs these 200 steps slower).
    `make_rows(rng, batch, seq_len)`: another task's natural-order rows (BATCH_KEYS) to train on
    (benchmarks/ruler_synthetic.py's)."""
    mesh = mesh_lib.make_mesh(config.mesh)
    layout, sp, d = config.attention.layout, int(mesh.shape[mesh_lib.SP]), config.data
    perm = layout_lib.permutation(layout, d.seq_len, sp)
    rng = np.random.default_rng(seed)
    if make_rows is None:
        def make_rows(rng, batch, seq_len):
            return synthetic_rows(rng, batch, seq_len, config.model.vocab_size,
                                  num_values=SYNTHETIC_NUM_VALUES, sp=sp, layout=layout)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, layout)
        state = setup.init(jax.random.PRNGKey(seed))
        train_step, _ = train_steps.jit_steps(config, setup)
        compiled = None
        for _ in range(config.train.num_steps):
            rows = make_rows(rng, d.global_batch_size, d.seq_len)
            batch = {k: jax.device_put(rows[k][:, perm], setup.batch_sharding)
                     for k in train_steps.BATCH_KEYS}
            if compiled is None:
                compiled = train_step.compiled(state, batch, compiler_options)
            state, _ = compiled(state, batch)
            # One step in flight at a time: with many queued on virtual CPU devices, XLA:CPU's
            # all-gathers were seen to deadlock (5 of 8 devices at the rendezvous, abort at 40 s).
            jax.block_until_ready(state)
    return inference.make_runner(config, lambda *_: state.params, mesh=mesh, setup=setup, layout=layout)


def synthetic_report(runner, rows: int = 128, seed: int = 1) -> dict:
    """Accuracy on held-out rows: the needle on another shard in the same document; the same in
    the previous document; and those again with the document mask off (use_segment_ids=False)."""
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
