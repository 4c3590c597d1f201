"""Which attention block sizes the ring accepts, and the one block chooser for running a model at
a length or on a mesh it was not configured for.

The ring (ops/ring.py) cuts every sequence shard of L = seq_len / sp tokens into blocks: a block
must divide L, and for the splash kernel be a multiple of 128 (the TPU's lanes; the same rule in
Pallas interpret mode on CPU, so that what runs here compiles there). A block inside one zigzag
half is one run of positions, so the chooser keeps blocks dividing the half as well.

Used by config validation (`validate`: a block the ring would refuse fails there, with the block
to use), by inference (`fit_block`: a checkpoint run at another length or mesh) and by
scripts/convert_hf.py check-logits (`padded_length`: the shortest padding of its rows that some
block fits). Pure Python: config validation imports it before jax.
"""

from __future__ import annotations

import math

SPLASH_BLOCK_MULTIPLE = 128  # TPU lanes: splash's blocks are whole lane tiles


def block_multiple(impl: str) -> int:
    """Every block of `impl` is a multiple of this."""
    return SPLASH_BLOCK_MULTIPLE if impl == "splash" else 1


def _unit(shard_len: int, layout: str) -> int:
    """What a block must divide: the shard, or each half of it for zigzag (and auto, which may
    resolve to zigzag)."""
    halves = layout in ("zigzag", "auto") and shard_len % 2 == 0
    return shard_len // 2 if halves else shard_len


def block_problem(block: int, shard_len: int, impl: str) -> str | None:
    """Why the ring refuses `block` on shards of `shard_len` tokens with `impl`, or None."""
    if block < 1 or shard_len % block:
        return f"does not divide the per-device shard of {shard_len} tokens"
    if block % block_multiple(impl):
        return f"must be a multiple of {SPLASH_BLOCK_MULTIPLE} for attention.impl='splash' (TPU lanes)"
    return None


def fit_block(largest: int, shard_len: int, impl: str, layout: str) -> int | None:
    """The largest block <= `largest` (halving it) that the ring accepts on shards of `shard_len`
    tokens and that divides the layout's pieces; None where there is none (splash on shards
    shorter than 128 tokens)."""
    unit, multiple = _unit(shard_len, layout), block_multiple(impl)
    block = largest
    while block >= multiple:
        if block % multiple == 0 and unit % block == 0:
            return block
        block //= 2
    return None


SMALLEST_PADDING_BLOCK = 16  # below it, padding saved is a few tokens and the block tables grow


def padded_length(n: int, sp: int, impl: str, layout: str, largest: int,
                  smallest: int | None = None) -> tuple[int, int]:
    """(seq_len, block): the shortest sequence length >= n whose sp shards of whole blocks the ring
    accepts, with blocks from `largest` (at least the impl's multiple) down to `smallest` tokens
    (halving; default SMALLEST_PADDING_BLOCK), and the largest such
    block at that length.

    A block b needs seq_len to be a multiple of sp * b (twice that for zigzag, whose shards are
    two halves), so smaller blocks pad less; splash stops at 128."""
    halves = 2 if layout in ("zigzag", "auto") else 1
    best = None
    block = max(largest, block_multiple(impl))
    while block >= max(block_multiple(impl), smallest or SMALLEST_PADDING_BLOCK, 1):
        if block % block_multiple(impl) == 0:
            unit = sp * block * halves
            seq_len = max(unit, math.ceil(n / unit) * unit)
            if best is None or seq_len < best[0]:
                best = (seq_len, block)
        block //= 2
    if best is None:
        raise ValueError(f"no block of at most {largest} tokens is a multiple of {block_multiple(impl)}")
    return best
