"""Sequence layouts: permutations of global positions across the sp shards."""

import numpy as np
import pytest

from longctx.parallel import layout


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


def test_striped_deals_stripes_round_robin():
    # sp=2, shards of 8 -> stripes of 4: shard 0 = stripes 0, 2; shard 1 = stripes 1, 3
    np.testing.assert_array_equal(layout.permutation("striped", 16, 2),
                                  [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
    pos = layout.shard_positions("striped", 4096, 4)  # shards of 1024: stripes of 512
    for d in range(4):
        np.testing.assert_array_equal(pos[d], np.r_[512 * d:512 * (d + 1),
                                                    512 * (d + 4):512 * (d + 5)])


def test_odd_shards_get_token_stripes():
    np.testing.assert_array_equal(layout.permutation("striped", 6, 2), [0, 2, 4, 1, 3, 5])
    pos = layout.shard_positions("striped", 45, 3)
    for d in range(3):
        assert (pos[d] % 3 == d).all() and (np.diff(pos[d]) == 3).all()


@pytest.mark.parametrize("shard_len,width", [(1, 1), (15, 1), (2, 1), (4, 2), (12, 4), (96, 32),
                                             (512, 256), (1024, 512), (1536, 512), (2 ** 20, 512)])
def test_stripe_width_is_the_largest_power_of_two_up_to_512_leaving_two_stripes(shard_len, width):
    assert layout.stripe_width(shard_len) == width


@pytest.mark.parametrize("name,shard_len,length", [
    ("contiguous", 1024, 1024), ("zigzag", 1024, 512), ("striped", 1024, 512), ("striped", 96, 32),
    ("striped", 15, 1)])
def test_piece_length_spans_consecutive_positions(name, shard_len, length):
    assert layout.piece_length(name, shard_len) == length
    pieces = layout.shard_positions(name, 2 * shard_len, 2)[0].reshape(-1, length)
    assert (np.diff(pieces, axis=1) == 1).all()  # consecutive within a piece
    assert (np.diff(pieces[:, 0]) > length).all()  # and a jump to the next


def test_piece_length_of_an_odd_zigzag_shard_is_the_shard():
    assert layout.piece_length("zigzag", 15) == 15  # (zigzag rejects it; default blocks don't)


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
