"""Block tables and schedule stats, checked against dense masks built from global positions."""

import numpy as np
import pytest

from longctx import layout as layout_lib
from longctx import masks

MASKS = {
    "full": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, sliding_window=40),
    "two_sided_window": dict(sliding_window=(30, 9)),
    "chunked": dict(chunk_size=24),
    "chunked_window": dict(chunk_size=48, sliding_window=20),
}


def _dense(spec, qpos, kpos):
    return spec.allowed(qpos[:, None].astype(np.int64), kpos[None, :].astype(np.int64))


def _from_fwd_tables(tb, d, t, shard_len, bq, bkv):
    out = np.zeros((shard_len, shard_len), bool)
    seen = np.zeros((shard_len // bq, shard_len // bkv), int)
    data, blk = tb.fwd_data_next[d, t, 0], tb.fwd_block_mask[d, t, 0]
    for i, j in zip(*np.nonzero(blk)):
        kv = data[i, j]
        seen[i, kv] += 1
        rows, cols = slice(i * bq, (i + 1) * bq), slice(kv * bkv, (kv + 1) * bkv)
        out[rows, cols] = True if blk[i, j] == 2 else tb.partial[tb.fwd_mask_next[d, t, 0, i, j]]
    assert seen.max(initial=0) <= 1, "a block is visited twice"
    return out


def _from_dkv_tables(tb, d, t, shard_len, bq, bkv):
    out = np.zeros((shard_len, shard_len), bool)
    data, blk = tb.dkv_data_next[d, t, 0], tb.dkv_block_mask[d, t, 0]
    for r, j in zip(*np.nonzero(blk)):
        i = data[r, j]
        rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bkv, (j + 1) * bkv)
        # the dkv kernel reads partial blocks transposed: [kv, q]
        out[rows, cols] = True if blk[r, j] == 2 else tb.partial.swapaxes(1, 2)[
            tb.dkv_mask_next[d, t, 0, r, j]].T
    return out


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("layout", layout_lib.LAYOUTS)
@pytest.mark.parametrize("bq,bkv", [(16, 16), (32, 16)])
def test_tables_reproduce_the_dense_mask(name, layout, bq, bkv):
    sp, seq_len = 4, 256
    shard_len = seq_len // sp
    spec = masks.make_mask_spec(**MASKS[name])
    tb = masks.ring_tables(spec, layout, seq_len, sp, bq, bkv)
    pos = layout_lib.shard_positions(layout, seq_len, sp)
    for d in range(sp):
        for s in range(sp):
            dense = _dense(spec, pos[d], pos[(d - s) % sp])
            if s not in tb.run_steps:
                assert not dense.any(), f"step {s} has work but is pruned"
                continue
            t = tb.run_steps.index(s)
            np.testing.assert_array_equal(_from_fwd_tables(tb, d, t, shard_len, bq, bkv), dense)
            np.testing.assert_array_equal(_from_dkv_tables(tb, d, t, shard_len, bq, bkv), dense)
            assert tb.active[d, t] == dense.any()
            np.testing.assert_array_equal(tb.kv_block_active[d, t],
                                          dense.reshape(shard_len, -1, bkv).any(axis=(0, 2)))
            assert tb.kv_source[d, t] == (d - s) % sp


def test_partial_blocks_are_deduplicated():
    tb = masks.ring_tables(masks.make_mask_spec(causal=True), "contiguous", 1024, 4, 64, 64)
    assert tb.partial.shape[0] == 1  # only the diagonal block is partial, and it is shared


def test_schedule_targets_at_131072_tokens_on_8_devices():
    S, sp, block = 131072, 8, 512
    contiguous = masks.ring_schedule(S, sp, block, "contiguous", causal=True)
    assert 0.5 < contiguous.efficiency < 0.6 and contiguous.steps == 8
    best = masks.resolve_layout("auto", S, sp, causal=True)
    assert masks.ring_schedule(S, sp, block, best, causal=True).efficiency >= 0.95
    best = masks.resolve_layout("auto", S, sp, causal=True, sliding_window=4096)
    window = masks.ring_schedule(S, sp, block, best, causal=True, sliding_window=4096)
    assert window.steps <= 2 and window.efficiency >= 0.9
    best = masks.resolve_layout("auto", S, sp, causal=True, chunk_size=8192)
    assert masks.ring_schedule(S, sp, block, best, causal=True, chunk_size=8192).steps == 1


def test_efficiency_formula_on_a_hand_computed_case():
    # contiguous causal, sp=2, 2 blocks per shard: step 0 computes 3 blocks on each device
    # (lower triangle of 2x2 blocks), step 1 computes 4 on device 1 and 0 on device 0.
    sched = masks.ring_schedule(8, 2, 2, "contiguous", causal=True)
    np.testing.assert_array_equal(sched.computed_blocks, [[3, 0], [3, 4]])
    assert sched.run_steps == (0, 1)
    assert sched.efficiency == pytest.approx(10 / (2 * (3 + 4)))


def test_auto_prefers_fewer_wasted_steps_for_windows():
    assert masks.resolve_layout("auto", 4096, 4, causal=True) in ("zigzag", "striped")
    assert masks.resolve_layout("auto", 4096, 4, causal=True, sliding_window=128) == "contiguous"
    # zigzag is impossible when seq_len is not divisible by 2*sp; auto never picks it then
    assert masks.resolve_layout("auto", 12, 4, causal=True) != "zigzag"
    assert masks.resolve_layout("striped", 12, 4) == "striped"


def test_bad_mask_arguments():
    with pytest.raises(ValueError, match=r"sliding_window=-3 must be non-negative"):
        masks.make_mask_spec(sliding_window=-3)
    with pytest.raises(ValueError, match=r"sliding_window=\(4, -1\)"):
        masks.make_mask_spec(sliding_window=(4, -1))
    with pytest.raises(ValueError, match=r"sliding_window='big'"):
        masks.make_mask_spec(sliding_window="big")
    with pytest.raises(ValueError, match=r"chunk_size=0"):
        masks.make_mask_spec(chunk_size=0)
    with pytest.raises(ValueError, match=r"block_size=48 does not divide the shard length 64"):
        masks.ring_schedule(256, 4, 48, "contiguous")
    with pytest.raises(ValueError, match=r"layout='auto'"):
        masks.ring_schedule(256, 4, 16, "auto")
