"""Seeded synthetic document lengths, to measure packers and the ring on data shaped like
long-context pretraining (scripts/ring_report.py --mix). Only the lengths matter there: the
ring's work depends on where documents start and end, not on their tokens.

  long_tail  most documents short, a few very long: 98% log-normal around 1,000 tokens
             (sigma 1), clipped to [64, 4,096]; 2% uniform in [65,536, 262,144]. By tokens the
             long ones are about 70% of the mix, as in long-context data mixtures where
             a few books or repositories hold most of the tokens.
  uniform    uniform in [1,024, 32,768] tokens.
"""

from __future__ import annotations

import numpy as np

MIXES = ("long_tail", "uniform")


def document_lengths(mix: str, num_tokens: int, seed: int = 0) -> np.ndarray:
    """int64 lengths (tokens per document, BOS and EOS included) of documents drawn from `mix`
    until they hold at least `num_tokens` tokens; the same for the same arguments."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r} is not one of {MIXES}")
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < num_tokens:
        if mix == "uniform":
            n = rng.integers(1_024, 32_768, endpoint=True, size=256)
        else:
            short = np.clip(rng.lognormal(np.log(1_000), 1.0, size=256), 64, 4_096).astype(np.int64)
            long = rng.integers(65_536, 262_144, endpoint=True, size=256)
            n = np.where(rng.random(256) < 0.02, long, short)
        out.append(n)
        total += int(n.sum())
    lengths = np.concatenate(out)
    return lengths[:int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1]


def documents(lengths, vocab_size: int = 256) -> list[np.ndarray]:
    """Documents of those lengths (int32 ids, their index modulo `vocab_size` as every token)."""
    return [np.full(int(n), i % vocab_size, np.int32) for i, n in enumerate(lengths)]


def segment_ids_of(lengths, seq_len: int) -> np.ndarray:
    """Natural-order segment ids [1, seq_len] (1, 2, ...) of documents of `lengths`, repeated in
    order until the row is full (the last one cut at the row's end)."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"document lengths {lengths}: give at least one, each positive.")
    ids, t, doc = np.zeros(seq_len, np.int32), 0, 1
    while t < seq_len:
        n = min(lengths[(doc - 1) % len(lengths)], seq_len - t)
        ids[t:t + n], t, doc = doc, t + n, doc + 1
    return ids[None]
