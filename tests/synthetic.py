"""Data the tests make up: packed batches of random documents with boundaries anywhere
(`packed_rows`), and a small jsonl corpus of tagged documents for the data pipeline
(`make_corpus`; prepared once per worker as the `data_dir` fixture of tests/data/conftest.py)."""

import json
import random

import numpy as np

from longctx.parallel import layout as layout_lib


def packed_rows(batch: int, seq_len: int, vocab: int, seed: int, mean_doc_len: int = 64):
    """Natural-order [batch, seq_len] int32 arrays: tokens, segment_ids (1-based, 0 = padding),
    positions (restart per document), targets (next token in the document), loss_mask."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((batch, seq_len), np.int32)
           for k in ("tokens", "segment_ids", "positions", "targets", "loss_mask")}
    for b in range(batch):
        tokens = rng.integers(0, vocab, seq_len)
        t, seg = 0, 1
        used = seq_len - int(rng.integers(0, seq_len // 8))  # a padded tail in some rows
        while t < used:
            n = min(int(rng.integers(1, 2 * mean_doc_len)), used - t)
            out["tokens"][b, t:t + n] = tokens[t:t + n]
            out["segment_ids"][b, t:t + n] = seg
            out["positions"][b, t:t + n] = np.arange(n)
            out["targets"][b, t:t + n - 1] = tokens[t + 1:t + n]
            out["loss_mask"][b, t:t + n - 1] = 1
            t, seg = t + n, seg + 1
    return out


def to_layout(rows: dict, layout: str, sp: int) -> dict:
    perm = layout_lib.permutation(layout, rows["tokens"].shape[1], sp)
    return {k: v[:, perm] for k, v in rows.items()}


def make_corpus(directory, num_docs: int = 120, seed: int = 0, short: int = 64):
    """jsonl of ASCII documents, each tagged with its id (`<0042>`); a fifth are longer than
    `short` tokens (up to 5x), the others shorter. Returns the file's path."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_docs):
        n = rng.randint(short, 5 * short) if i % 5 == 0 else rng.randint(1, short - 2)
        body = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz .,\n") for _ in range(n))
        lines.append(json.dumps({"text": f"<{i:04d}>" + body}))
    path = directory / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
