"""The two helpers the data, the ops and the benchmarks share (one copy each): positions within a
document (ops/masks.segment_positions: packed rows' positions, the ring's chunk ids, the
benchmarks' references) and a piece's causal blocks (data/dispatch.causal_blocks: shard_balanced's
work estimate and packer_report's contiguous bound), each against a count done by hand."""

import numpy as np
import pytest

from longctx.data import dispatch
from longctx.ops import masks


def positions_by_hand(row):
    out, previous, run = [], None, 0
    for sid in row:
        run = run + 1 if sid == previous else 0
        previous = sid
        out.append(run if sid > 0 else 0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_segment_positions_restart_at_every_document_and_are_zero_on_padding(seed):
    rng = np.random.default_rng(seed)
    # Runs of ids, with padding (0, and -1 as the chunk ids keep it) anywhere, repeats included.
    rows = np.repeat(rng.integers(-1, 4, (3, 40)), rng.integers(1, 5, 40), axis=1)
    got = masks.segment_positions(rows)
    assert got.dtype == np.int32 and got.shape == rows.shape
    assert got.tolist() == [positions_by_hand(r) for r in rows]
    assert masks.segment_positions(rows[0]).tolist() == positions_by_hand(rows[0])  # one row


def causal_blocks_by_hand(n, block):
    """Blocks (q, k) of a piece of n tokens starting on a block that hold a pair k <= q."""
    return sum(1 for qb in range(-(-n // block)) for kb in range(qb + 1)
               if kb * block <= min(n - 1, qb * block + block - 1))


def test_causal_blocks_of_a_piece_and_of_an_array_of_pieces():
    lengths = np.array([1, 7, 8, 9, 16, 17, 63, 64, 65, 200])
    for block in (1, 8, 16):
        expected = [causal_blocks_by_hand(int(n), block) for n in lengths]
        assert [dispatch.causal_blocks(int(n), block) for n in lengths] == expected
        assert dispatch.causal_blocks(lengths, block).tolist() == expected
