"""Sequence layouts: which global token positions each `sp` shard holds.

A layout is a permutation `perm` of `range(seq_len)` with

    x_layout = x_natural[..., perm, ...]

and shard `d` of the ring holding `x_layout[d * L:(d + 1) * L]`, `L = seq_len // num_shards`.
The data pipeline applies it once per row (tokens, positions, segment ids, targets, loss mask
move together); the attention masks are always evaluated on the *global* positions
`perm[d * L + i]`, so the model never reorders anything.

- "contiguous": identity. Shard d holds positions [d*L, (d+1)*L).
- "zigzag": the sequence is cut into 2*sp chunks; shard d holds chunks d and 2*sp-1-d, so every
  shard owns one early and one late chunk and causal work is balanced.
- "striped": the sequence is cut into stripes of `stripe_width(L)` tokens, dealt round-robin:
  stripe c lives on shard c mod sp. Every shard holds an even spread of early and late stripes,
  so each ring step gives every shard a similar share of the causal work, not only the ring as a
  whole.
- "per_document" (ROW_LAYOUTS): not a permutation of positions but each row's own, worked out in
  the data pipeline from its documents (document_layout.py); the ring reads every token's
  global position from the data.

Why stripes of many tokens, not the token stripes of Striped Attention (Brandon et al., 2023):
the ring's kernels skip work per block, never per element. With token stripes every block on
the local diagonal is half masked at every ring step (a partial block that costs a full one), so
the ring computed 160 blocks where the causal mask needs 136 (S = 8192, sp = 4, block 512: 18%
more work, at the same busiest-device path). When a block lies inside one stripe, the block
classes are those of the global causal mask and nothing is wasted; the balance at block
granularity is the same.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")
# Layouts that differ from row to row, worked out from each row's documents in the data
# pipeline (document_layout.py); the ring learns each token's position from the data.
PER_DOCUMENT = "per_document"
ROW_LAYOUTS = (PER_DOCUMENT,)


def per_row(layout: str) -> bool:
    """Whether `layout` is a permutation of each row's own, not one for every row."""
    return layout in ROW_LAYOUTS
MAX_STRIPE = 512  # the ring's largest default block (masks.default_block_size)


def stripe_width(shard_len: int) -> int:
    """Tokens per stripe of the striped layout: the largest power of two up to MAX_STRIPE that
    divides the shard length and leaves at least two stripes on each shard; 1 (token stripes)
    when none does (an odd shard length, or 2). A function of the shard length only, so that
    the data pipeline and the ring agree without being told; masks.default_block_size picks a
    block dividing it."""
    width = MAX_STRIPE
    while width > 1 and (shard_len % width or shard_len // width < 2):
        width //= 2
    return width


def piece_length(layout: str, shard_len: int) -> int:
    """How many tokens of a shard hold consecutive global positions, piece after piece: the
    whole shard (contiguous), each half (zigzag; the whole shard if its length is odd, which
    zigzag never allows), each stripe (striped; 1 for token stripes). A ring block inside one
    piece is one run of positions (ops/tables.block_runs), so the default blocks divide it."""
    if layout == "zigzag" and shard_len % 2 == 0:
        return shard_len // 2
    if layout == "striped":
        return stripe_width(shard_len)
    return shard_len


def _check(layout: str, seq_len: int, num_shards: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be a positive integer")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be a positive integer")
    # zigzag cuts the sequence into 2*sp equal chunks, the others into sp shards.
    parts = 2 * num_shards if layout == "zigzag" else num_shards
    if seq_len % parts:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by {parts} "
            f"({'2*' if layout == 'zigzag' else ''}num_shards, num_shards={num_shards}) "
            f"for layout={layout!r}")


def permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """Returns int64 `perm` with `x_layout = x_natural[..., perm, ...]`."""
    _check(layout, seq_len, num_shards)
    if layout == "contiguous":
        return np.arange(seq_len)
    if layout == "zigzag":
        chunks = np.arange(seq_len).reshape(2 * num_shards, -1)
        order = [c for d in range(num_shards) for c in (d, 2 * num_shards - 1 - d)]
        return chunks[order].reshape(-1)
    # striped: [stripe c, shard d, token r] -> shard d takes stripes d, d + sp, d + 2 * sp, ...
    width = stripe_width(seq_len // num_shards)
    return np.arange(seq_len).reshape(-1, num_shards, width).transpose(1, 0, 2).reshape(-1)


def positions_on_device(layout: str, seq_len: int, num_shards: int, shard, local):
    """Global positions of local indices `local` on shard `shard` (traced ints allowed), in
    closed form: `shard_positions(...)[shard, local]` without a [num_shards, L] table in the
    program. int32."""
    _check(layout, seq_len, num_shards)
    L = seq_len // num_shards
    shard, local = jnp.asarray(shard, jnp.int32), jnp.asarray(local, jnp.int32)
    if layout == "contiguous":
        return shard * L + local
    if layout == "striped":
        width = stripe_width(L)
        return (local // width * num_shards + shard) * width + local % width
    half = L // 2  # zigzag: chunk `shard`, then chunk 2 * sp - 1 - shard, each L/2 long
    return jnp.where(local < half, shard * half + local,
                     (2 * num_shards - 1 - shard) * half + local - half)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """`inv` with `x_natural = x_layout[..., inv, ...]`."""
    perm = np.asarray(perm)
    if perm.ndim != 1 or not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise ValueError(f"perm (shape {perm.shape}) is not a permutation of range(n)")
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def shard_positions(layout: str, seq_len: int, num_shards: int) -> np.ndarray:
    """Global positions held by every shard: int array [num_shards, seq_len // num_shards]."""
    return permutation(layout, seq_len, num_shards).reshape(num_shards, -1)
