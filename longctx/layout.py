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
- "striped": token t lives on shard t mod sp (shard d holds d, d+sp, d+2*sp, ...), which balances
  causal work at element granularity.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")


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
    # striped: row-major [L, sp] -> shard d takes column d.
    return np.arange(seq_len).reshape(-1, num_shards).T.reshape(-1)


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
        return shard + num_shards * local
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
