"""Sequence layouts: permutations of global positions across the sp shards."""

import numpy as np
import pytest

from longctx import layout


@pytest.mark.parametrize("name", layout.LAYOUTS)
@pytest.mark.parametrize("seq_len,sp", [(16, 1), (16, 2), (32, 4), (64, 8)])
def test_is_a_permutation_and_inverse_undoes_it(name, seq_len, sp):
    perm = layout.permutation(name, seq_len, sp)
    assert sorted(perm.tolist()) == list(range(seq_len))
    x = np.arange(seq_len) * 10
    inv = layout.inverse_permutation(perm)
    np.testing.assert_array_equal(x[perm][inv], x)
    np.testing.assert_array_equal(layout.shard_positions(name, seq_len, sp).reshape(-1), perm)


def test_contiguous_is_identity():
    np.testing.assert_array_equal(layout.permutation("contiguous", 12, 3), np.arange(12))


def test_zigzag_shard_d_holds_chunks_d_and_2sp_minus_1_minus_d():
    # sp=2 -> 4 chunks of 2: shard 0 = chunks 0,3; shard 1 = chunks 1,2
    np.testing.assert_array_equal(layout.permutation("zigzag", 8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    pos = layout.shard_positions("zigzag", 64, 4)  # chunks of 8
    for d in range(4):
        np.testing.assert_array_equal(pos[d], np.r_[8 * d:8 * d + 8, 8 * (7 - d):8 * (7 - d) + 8])


def test_striped_token_t_on_shard_t_mod_sp():
    np.testing.assert_array_equal(layout.permutation("striped", 8, 2), [0, 2, 4, 6, 1, 3, 5, 7])
    pos = layout.shard_positions("striped", 24, 3)
    for d in range(3):
        assert (pos[d] % 3 == d).all() and (np.diff(pos[d]) == 3).all()


def test_bad_input():
    with pytest.raises(ValueError, match=r"layout='diagonal'"):
        layout.permutation("diagonal", 8, 2)
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 4"):
        layout.permutation("contiguous", 10, 4)
    with pytest.raises(ValueError, match=r"seq_len=12 is not divisible by 8 \(2\*num_shards"):
        layout.permutation("zigzag", 12, 4)
    with pytest.raises(ValueError, match=r"num_shards=0"):
        layout.permutation("striped", 8, 0)
    with pytest.raises(ValueError, match="not a permutation"):
        layout.inverse_permutation(np.array([0, 0, 1]))
