"""The ring's block tables and schedule stats, checked against dense masks built from global
positions: static (mask x layout) and dynamic (segment ids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.ops import auto_layout, masks, tables
from longctx.parallel import layout as layout_lib
from tests import ROOT
from tests.validate_commands import ScriptServer

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


def _tables_on_device(spec, layout, seq_len, sp, bq, bkv):
    """f(d, t) -> the step's classes, kernel tables, element-mask inputs and pairs as the ring
    builds them on device (without documents: every kept block is live)."""
    tb = tables.ring_tables(spec, layout, seq_len, sp, bq, bkv)

    @jax.jit
    def step(d, t):
        blocks = tables.step_blocks(spec, layout, seq_len, sp, bq, bkv, d,
                                    jnp.asarray(tb.kv_source)[d, t])
        live = (blocks.classes > 0)[None]
        classes = tables.kernel_classes(blocks.classes, live, None, None)
        q_lo, q_hi = spec.bounds(blocks.q_positions)
        return dict(classes=blocks.classes, q_lo=q_lo, q_hi=q_hi, kv_pos=blocks.kv_positions,
                    fwd=tables.grid_tables(classes, tb.grid_width, axis=-1),
                    dkv=tables.grid_tables(classes, tb.grid_height, axis=-2),
                    pairs=tables.step_pairs(blocks.classes, tb.max_pairs))

    return tb, lambda d, t: jax.tree.map(np.asarray, step(d, t))


def _block_mask(step, i, j, bq, bkv, full):
    """What the kernels compute of block (i, j): all of a full block, and of a partial one the
    keys inside each query's interval (ops/splash_kernels._mask)."""
    if full:
        return True
    lo, hi = step["q_lo"][i * bq:(i + 1) * bq, None], step["q_hi"][i * bq:(i + 1) * bq, None]
    kv = step["kv_pos"][None, j * bkv:(j + 1) * bkv]
    return (kv >= lo) & (kv <= hi)


def _from_fwd_tables(step, shard_len, bq, bkv):
    """The dense [L, L] mask that the forward kernel's tables of one step compute."""
    out = np.zeros((shard_len, shard_len), bool)
    seen = np.zeros((shard_len // bq, shard_len // bkv), int)
    data, blk = (x[0, 0] for x in step["fwd"])
    for i, e in zip(*np.nonzero(blk)):
        j = data[i, e]
        seen[i, j] += 1
        rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bkv, (j + 1) * bkv)
        out[rows, cols] = _block_mask(step, i, j, bq, bkv, blk[i, e] == 2)
    assert seen.max(initial=0) <= 1, "a block is visited twice"
    return out


def _from_dkv_tables(step, shard_len, bq, bkv):
    """The same from the backward kernel's tables (packed along q)."""
    out = np.zeros((shard_len, shard_len), bool)
    data, blk = (x[0, 0] for x in step["dkv"])
    for e, j in zip(*np.nonzero(blk)):
        i = data[e, j]
        rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bkv, (j + 1) * bkv)
        out[rows, cols] = _block_mask(step, i, j, bq, bkv, blk[e, j] == 2)
    return out


def test_positions_on_device_are_the_layouts():
    for layout in layout_lib.LAYOUTS:
        for seq_len, sp in [(256, 4), (48, 3)]:
            got = layout_lib.positions_on_device(layout, seq_len, sp, jnp.arange(sp)[:, None],
                                                 jnp.arange(seq_len // sp)[None, :])
            np.testing.assert_array_equal(got, layout_lib.shard_positions(layout, seq_len, sp))


def _dense_blocks(spec, layout, seq_len, sp, bq, bkv):
    """{(d, s): (dense mask [L, L], block classes [q blocks, kv blocks])} from global positions."""
    pos = layout_lib.shard_positions(layout, seq_len, sp)
    out = {}
    for d in range(sp):
        for s in range(sp):
            dense = _dense(spec, pos[d], pos[(d - s) % sp])
            blocks = dense.reshape(dense.shape[0] // bq, bq, dense.shape[1] // bkv, bkv)
            kept, full = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
            out[d, s] = dense, np.where(full, 2, np.where(kept, 1, 0))
    return out


# Zigzag with seq_len 384 on 4 shards and 32-token blocks: the middle block of a shard holds the
# end of one half and the start of the other (two runs of positions).
SHAPES = [(layout, 256, bq, bkv) for layout in layout_lib.LAYOUTS
          for bq, bkv in [(16, 16), (32, 16)]] + [("zigzag", 384, 32, 32)]
# Blocks across stripes (stripes of 32 at L = 64; a q block of two stripes, a kv block of two
# and of one) and token stripes (L = 15 is odd).
STRIPED_SHAPES = [("striped", 256, 64, 32), ("striped", 256, 16, 64), ("striped", 60, 5, 3)]


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("layout,seq_len,bq,bkv", SHAPES + STRIPED_SHAPES)
def test_host_tables_are_the_dense_mask(name, layout, seq_len, bq, bkv):
    """The host's block classes, pruning and grid sizes, for every (device, step)."""
    sp = 4
    spec = masks.make_mask_spec(**MASKS[name])
    tb = tables.ring_tables(spec, layout, seq_len, sp, bq, bkv)
    for (d, s), (dense, classes) in _dense_blocks(spec, layout, seq_len, sp, bq, bkv).items():
        if s not in tb.run_steps:
            assert not dense.any(), f"step {s} has work but is pruned"
            continue
        t = tb.run_steps.index(s)
        np.testing.assert_array_equal(tb.classes[d, t], classes)
        assert tb.active[d, t] == dense.any()
        assert tb.kv_source[d, t] == (d - s) % sp
        assert (classes > 0).sum(axis=1).max() <= tb.grid_width
        assert (classes > 0).sum(axis=0).max() <= tb.grid_height
        assert (classes > 0).sum() <= tb.max_pairs


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("layout,seq_len,bq,bkv", [("contiguous", 256, 32, 16),
                                                   ("striped", 256, 32, 16), SHAPES[-1],
                                                   *STRIPED_SHAPES])
def test_device_tables_reproduce_the_dense_mask(name, layout, seq_len, bq, bkv):
    """Every table the ring builds on device, against the dense mask of global positions, for
    every (device, step): its block classes, the forward and backward kernels' tables and
    element masks rebuilt into a dense mask, and the XLA path's pairs."""
    sp = 4
    shard_len = seq_len // sp
    spec = masks.make_mask_spec(**MASKS[name])
    tb, step_tables = _tables_on_device(spec, layout, seq_len, sp, bq, bkv)
    for (d, s), (dense, classes) in _dense_blocks(spec, layout, seq_len, sp, bq, bkv).items():
        if s not in tb.run_steps:
            continue
        step = step_tables(d, tb.run_steps.index(s))
        np.testing.assert_array_equal(step["classes"], classes)
        np.testing.assert_array_equal(_from_fwd_tables(step, shard_len, bq, bkv), dense)
        np.testing.assert_array_equal(_from_dkv_tables(step, shard_len, bq, bkv), dense)
        (pairs, count), n = step["pairs"], int((classes > 0).sum())
        assert count == n
        np.testing.assert_array_equal(pairs[:n], np.argwhere(classes > 0))


def test_host_classes_from_runs_are_the_row_counts():
    """The host decides a block from its runs' ends (`_classes_of_runs`); the device counts every
    query row (`_classes`). The two agree on random masks, layouts, shards and block sizes,
    including blocks that cross pieces (zigzag's halves, stripes) and windows narrower than a
    block or wider than a shard."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        layout = str(rng.choice(layout_lib.LAYOUTS))
        sp = int(rng.choice([1, 2, 3, 4]))
        shard_len = 2 * int(rng.choice([12, 16, 24, 32]))
        seq_len = sp * shard_len
        bq, bkv = (int(rng.choice([b for b in (4, 6, 8, 12, 16) if shard_len % b == 0])) for _ in "qk")
        window = None if rng.random() < 0.3 else (int(rng.integers(0, 40)), int(rng.integers(0, 40)))
        causal = bool(rng.random() < 0.5)
        chunk = None if rng.random() < 0.6 else int(rng.integers(2, 50))
        spec = masks.MaskSpec(causal=causal, window=window, chunk=chunk)
        got = tables.block_classes(spec, layout, seq_len, sp, bq, bkv)
        pos = layout_lib.shard_positions(layout, seq_len, sp).astype(np.int64)
        first, length, stride = tables.block_runs(layout, seq_len, sp, bkv)
        for d in range(sp):
            for s in range(sp):
                rows = tables._classes(np, spec, pos[d], pos[(d - s) % sp][first], length, stride, bq, bkv)
                np.testing.assert_array_equal(got[d, s], rows, err_msg=f"{spec} {layout} {seq_len} "
                                              f"sp={sp} bq={bq} bkv={bkv} device {d} step {s}")


def test_kernel_classes_leave_unmasked_only_blocks_of_one_document():
    """A block the static mask keeps whole is full for the kernels only where its queries and
    keys all belong to one document; two documents, padding (ids <= 0) or a different document
    make it partial (masked element by element), and a block that is not live is 0."""
    ids = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 0, 0]], jnp.int32)  # blocks of 2 tokens
    docs = tables.block_documents(ids, 2)
    np.testing.assert_array_equal(docs, [[1, 1, 1, 2, 3, 0]])
    static = jnp.full((6, 6), 2, jnp.int32).at[0, 1].set(1)
    live = jnp.ones((1, 6, 6), bool).at[0, 5, 5].set(False)
    got = np.asarray(tables.kernel_classes(static, live, docs, docs))[0]
    assert got[0, 0] == 2 and got[0, 2] == 2   # one document on both sides
    assert got[0, 1] == 1                       # the static mask's own partial block
    assert got[0, 3] == 1 and got[3, 4] == 1    # different documents
    assert got[4, 4] == 2 and got[5, 4] == 1    # a block of padding is never unmasked
    assert got[5, 5] == 0                       # not live


def test_schedule_targets_at_131072_tokens_on_8_devices():
    S, sp, block = 131072, 8, 512
    contiguous = tables.ring_schedule(S, sp, block, "contiguous", causal=True)
    assert 0.5 < contiguous.efficiency < 0.6 and contiguous.steps == 8
    best = auto_layout.resolve_layout("auto", S, sp, causal=True)
    assert tables.ring_schedule(S, sp, block, best, causal=True).efficiency >= 0.95
    best = auto_layout.resolve_layout("auto", S, sp, causal=True, sliding_window=4096)
    window = tables.ring_schedule(S, sp, block, best, causal=True, sliding_window=4096)
    assert window.steps <= 2 and window.efficiency >= 0.9
    best = auto_layout.resolve_layout("auto", S, sp, causal=True, chunk_size=8192)
    assert tables.ring_schedule(S, sp, block, best, causal=True, chunk_size=8192).steps == 1


def test_efficiency_formula_on_a_hand_computed_case():
    # contiguous causal, sp=2, 2 blocks per shard: step 0 computes 3 blocks on each device
    # (lower triangle of 2x2 blocks), step 1 computes 4 on device 1 and 0 on device 0.
    sched = tables.ring_schedule(8, 2, 2, "contiguous", causal=True)
    np.testing.assert_array_equal(sched.computed_blocks, [[3, 0], [3, 4]])
    assert sched.run_steps == (0, 1)
    assert sched.efficiency == pytest.approx(10 / (2 * (3 + 4)))


def test_auto_prefers_fewer_wasted_steps_for_windows():
    assert auto_layout.resolve_layout("auto", 4096, 4, causal=True) in ("zigzag", "striped")
    assert auto_layout.resolve_layout("auto", 4096, 4, causal=True, sliding_window=128) == "contiguous"
    # zigzag is impossible when seq_len is not divisible by 2*sp; auto never picks it then
    assert auto_layout.resolve_layout("auto", 12, 4, causal=True) != "zigzag"
    assert auto_layout.resolve_layout("striped", 12, 4) == "striped"


def test_auto_for_layers_of_several_masks_weighs_each_by_its_layer_count():
    """A hybrid model's one layout: the layout whose rings, summed over the layer types weighted by
    their layer counts, finish first (the cost written out here from ring_schedule)."""
    seq_len, sp, block = 32768, 8, 512
    masks_ = {"global": dict(causal=True, sliding_window=None, chunk_size=None),
              "window": dict(causal=True, sliding_window=1024, chunk_size=None)}

    def cost(layout, mask):
        sched = tables.ring_schedule(seq_len, sp, block, layout, **mask)
        return (sched.critical_path + sched.steps) * block * block

    for name, mask in masks_.items():  # one type: resolve_layout itself
        assert (auto_layout.resolve_layout_for_layers("auto", seq_len, sp, [(3, mask, block)])
                == auto_layout.resolve_layout("auto", seq_len, sp, block_size=block, **mask))
    chosen = {}
    for local_layers in (1, 5, 30):
        layers = [(local_layers, masks_["window"], block), (1, masks_["global"], block)]
        chosen[local_layers] = auto_layout.resolve_layout_for_layers("auto", seq_len, sp, layers)
        expected = min(layout_lib.LAYOUTS, key=lambda layout: local_layers * cost(layout, masks_["window"])
                       + cost(layout, masks_["global"]))
        assert chosen[local_layers] == expected, local_layers
    assert chosen[1] != chosen[30]  # the count matters


# Windows at and past int32's reach: 2**30 is where the cap starts, 2**31 - 511 the first whose
# pos + window wrapped at 512 tokens, 2**31 - 1 the largest int32, 2**31 the first past it.
HUGE_WINDOWS = (2**30 - 1, 2**30, 2**31 - 512, 2**31 - 511, 2**31 - 1, 2**31, 2**63)


@pytest.mark.parametrize("window", HUGE_WINDOWS)
def test_a_window_past_every_position_is_the_full_mask_on_device(window):
    """A two-sided window meant as "unbounded" allows every key, on device (int32 positions) as
    on the host: pos + window must not wrap, and a window past int32 must not raise in jit."""
    spec = masks.make_mask_spec(sliding_window=(window, window))
    pos = jnp.arange(512, dtype=jnp.int32)
    lo, hi = jax.jit(spec.bounds)(pos)
    assert int(lo.max()) <= 0 and int(hi.min()) >= 511, (int(lo.max()), int(hi.min()))
    allowed = jax.jit(spec.allowed)(pos[:, None], pos[None, :])
    assert bool(allowed.all())
    host_lo, host_hi = spec.bounds(np.arange(512))
    assert host_lo.max() <= 0 and host_hi.min() >= 511


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
        tables.ring_schedule(256, 4, 48, "contiguous")
    with pytest.raises(ValueError, match=r"layout='auto'"):
        tables.ring_schedule(256, 4, 16, "auto")


# ----------------------------------------------------------------------------- documents


def _packed_ids(rng, batch, seq_len, mean_doc, padding=True):
    """Natural-order packed ids: documents 1, 2, ... of random lengths (1-token ones included),
    then a padding tail (0) in some rows."""
    ids = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        used = seq_len - (int(rng.integers(0, seq_len // 4)) if padding else 0)
        t, doc = 0, 1
        while t < used:
            n = min(int(rng.integers(1, 2 * mean_doc)), used - t)
            ids[b, t:t + n], t, doc = doc, t + n, doc + 1
    return ids


def _live(tb, spec, layout, seq_len, sp, ids, bq, bkv):
    """live[d][t] [b, q_blocks, kv_blocks] from the device functions, on each shard's ids."""
    shard = ids[:, layout_lib.permutation(layout, seq_len, sp)].reshape(ids.shape[0], sp, -1)
    return [[np.asarray(tables.live_blocks(
        tb.classes[d, t], tables.document_ranges(shard[:, d], bq),
        tables.document_ranges(shard[:, tb.kv_source[d, t]], bkv))) for t in range(len(tb.run_steps))]
        for d in range(sp)]


@pytest.mark.parametrize("name", ["causal", "causal_window", "full", "chunked"])
@pytest.mark.parametrize("layout", layout_lib.LAYOUTS)
def test_live_blocks_never_drop_a_needed_block(name, layout):
    """Every block holding a (query, key) pair that the mask and the documents allow is live
    (padding allows nothing); for causal masks the ranges are exact in every layout whose blocks
    hold consecutive positions (here striped's too: stripes of 32, blocks of 16), so the live
    blocks are exactly the needed ones."""
    sp, seq_len, bq, bkv = 4, 256, 16, 16
    spec = masks.make_mask_spec(**MASKS[name])
    tb = tables.ring_tables(spec, layout, seq_len, sp, bq, bkv)
    ids = _packed_ids(np.random.default_rng(0), 3, seq_len, mean_doc=20)
    pos = layout_lib.shard_positions(layout, seq_len, sp)
    perm = layout_lib.permutation(layout, seq_len, sp)
    shard_ids = ids[:, perm].reshape(3, sp, -1)
    live = _live(tb, spec, layout, seq_len, sp, ids, bq, bkv)
    for d in range(sp):
        for t, s in enumerate(tb.run_steps):
            src = (d - s) % sp
            qi, ki = shard_ids[:, d], shard_ids[:, src]
            allowed = (_dense(spec, pos[d], pos[src])[None] & (qi[:, :, None] == ki[:, None, :])
                       & (qi > 0)[:, :, None] & (ki > 0)[:, None, :])
            needed = allowed.reshape(3, -1, bq, allowed.shape[2] // bkv, bkv).any(axis=(2, 4))
            assert not (needed & ~live[d][t]).any(), f"a needed block is not live (d={d}, s={s})"
            if name == "causal":
                np.testing.assert_array_equal(live[d][t], needed)


def test_documents_inside_shards_skip_every_other_step():
    """Rows whose documents never cross a shard edge: no block of any step but the first is
    live, so the ring runs one kernel per device and only passes K/V on."""
    sp, seq_len, block = 4, 256, 16
    shard = seq_len // sp
    ids = np.concatenate([_packed_ids(np.random.default_rng(d), 2, shard, mean_doc=12) + 100 * d
                          for d in range(sp)], axis=1)  # ids keep increasing; padding stays 0
    ids = np.where(ids % 100 == 0, 0, ids)
    spec = masks.make_mask_spec(causal=True)
    tb = tables.ring_tables(spec, "contiguous", seq_len, sp, block, block)
    assert tb.run_steps == (0, 1, 2, 3)  # the static mask alone needs every step
    live = _live(tb, spec, "contiguous", seq_len, sp, ids, block, block)
    for d in range(sp):
        assert live[d][0].any()
        assert not any(live[d][t].any() for t in range(1, sp)), f"device {d} computes off its shard"


def test_an_all_padding_block_is_never_live():
    ids = np.array([[0, 0, 0, 0, 3, 3, 4, 4]], np.int32)
    first, last = (np.asarray(x) for x in tables.document_ranges(ids, 4))
    assert first[0, 0] > last[0, 0]  # empty range
    np.testing.assert_array_equal((first[0, 1], last[0, 1]), (3, 4))
    live = np.asarray(tables.live_blocks(np.full((2, 2), 2, np.int8), (first, last), (first, last)))
    np.testing.assert_array_equal(live[0], [[False, False], [False, True]])


def test_xla_visits_compute_each_rows_own_live_blocks_once():
    """The XLA path's visits of a step: with documents, each row's live blocks once, for that
    row only (a block live in one row is not computed for the others); without, every kept
    block once, for all rows together."""
    from longctx.ops import xla
    kept = tables.block_classes(masks.make_mask_spec(causal=True), "contiguous", 128, 2, 16,
                                16)[1, 0] > 0  # [4, 4]: every block of the step
    live = kept[None] & (np.random.default_rng(0).random((3, 4, 4)) < 0.5)
    assert (live.any(axis=0) & ~live.all(axis=0)).any()  # rows that differ

    def computed(visits):
        """bool [3, 4, 4]: each (row, q block, kv block) the visits compute, asserting once."""
        seen = np.zeros((3, 4, 4), int)
        for r, i, j in np.asarray(visits.index)[:int(visits.count)]:
            seen[r:r + visits.rows, i, j] += 1
        assert seen.max() <= 1, "a block computed twice"
        return seen > 0

    max_pairs = int(kept.sum())
    np.testing.assert_array_equal(computed(xla.step_visits(jnp.asarray(live), 3, max_pairs)),
                                  live)
    np.testing.assert_array_equal(computed(xla.step_visits(jnp.asarray(kept[None]), 3, max_pairs)),
                                  np.broadcast_to(kept, (3, 4, 4)))


def test_dead_entries_are_off_and_fetch_nothing():
    """Grid entries that are not live: block_mask 0, and data_next repeating the previous live
    entry (the first live one before any), so the DMA index does not change."""
    data = np.array([[3, 5, 6, 7]], np.int32)
    block = np.array([[2, 1, 2, 1]], np.int32)
    live = np.array([[False, True, False, True]])
    d, b = (np.asarray(x) for x in tables.skip_dead_entries(data, block, live))
    np.testing.assert_array_equal(b, [[0, 1, 0, 1]])
    np.testing.assert_array_equal(d, [[5, 5, 5, 7]])
    # along the other axis (the backward's tables pack q blocks along axis -2)
    d2, b2 = (np.asarray(x) for x in tables.skip_dead_entries(data.T, block.T, live.T, axis=-2))
    np.testing.assert_array_equal(d2, d.T)
    np.testing.assert_array_equal(b2, b.T)


def test_document_schedule_by_hand():
    """S = 64 on 2 devices, blocks of 8, causal. Documents of 8 tokens on block edges: only the 8
    diagonal blocks are needed, all at step 0, 4 per device: efficiency 8 / (2 x 4) = 1. One
    document of 64 tokens: the whole causal triangle of blocks, 36, of which device 1 computes
    the 16 of step 1 alone: 36 / (2 x (10 + 16))."""
    spec = masks.make_mask_spec(causal=True)
    aligned = np.repeat(np.arange(1, 9, dtype=np.int32), 8)[None]
    sched = tables.document_schedule(spec, "contiguous", 64, 2, 8, aligned)
    assert sched.kept_blocks == 8 and sched.run_steps == (0,)
    np.testing.assert_array_equal(sched.computed_blocks, [[4, 0], [4, 0]])
    assert sched.efficiency == 1.0
    one = tables.document_schedule(spec, "contiguous", 64, 2, 8, np.ones((1, 64), np.int32))
    np.testing.assert_array_equal(one.computed_blocks, [[10, 0], [10, 16]])
    assert one.kept_blocks == 36 and one.efficiency == pytest.approx(36 / (2 * 26))
    # a padding row adds nothing
    padded = np.concatenate([aligned, np.zeros((1, 64), np.int32)])
    assert tables.document_schedule(spec, "contiguous", 64, 2, 8, padded).kept_blocks == 8
    # the ring visits the steps up to the last that runs: K/V go nowhere for `aligned`
    assert sched.visited_steps == (0,) and one.visited_steps == (0, 1)


def _random_documents(rows, seq_len, mean, seed):
    """Natural-order segment ids [rows, seq_len]: documents cut at random, of mean length `mean`."""
    rng = np.random.default_rng(seed)
    starts = np.zeros((rows, seq_len), np.int32)
    starts[:, 0] = 1
    for r in range(rows):
        starts[r, rng.choice(np.arange(1, seq_len), seq_len // mean - 1, replace=False)] = 1
    return np.cumsum(starts, axis=1).astype(np.int32)


def test_document_schedule_without_the_kept_count_computes_the_same():
    spec = masks.make_mask_spec(causal=True)
    docs = _random_documents(2, 4096, 256, seed=0)
    for layout in ("contiguous", "zigzag", "striped"):
        full = tables.document_schedule(spec, layout, 4096, 4, 256, docs)
        cheap = tables.document_schedule(spec, layout, 4096, 4, 256, docs, count_kept=False)
        assert cheap.kept_blocks is None and full.kept_blocks > 0
        np.testing.assert_array_equal(cheap.computed_blocks, full.computed_blocks)
        assert (cheap.run_steps, cheap.visited_steps) == (full.run_steps, full.visited_steps)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_a_smaller_block_never_computes_more_pairs(layout):
    """A block of half the size is live only inside a live block of the larger size (its id
    ranges lie within the larger block's, and the static mask keeps no part of a block it drops),
    so the (query, key) pairs the ring computes never grow as the block shrinks; on short
    documents they shrink severalfold (bench_ring_blocks.py times it)."""
    spec = masks.make_mask_spec(causal=True)
    S, sp = 8192, 4
    docs = _random_documents(2, S, 256, seed=1)
    pairs = {}
    for block in (512, 256, 128):
        sched = tables.document_schedule(spec, layout, S, sp, block, docs, count_kept=False)
        pairs[block] = int(sched.computed_blocks.sum()) * block * block
    assert pairs[128] <= pairs[256] <= pairs[512], pairs
    assert pairs[128] < pairs[512] / 2, pairs


def _document_key(layout, seq_len, sp, block, docs):
    """resolve_layout's score with documents, from the schedule itself: (critical path + steps
    the ring goes through) in pairs, then blocks computed in all."""
    sched = tables.document_schedule(masks.make_mask_spec(causal=True), layout, seq_len, sp, block,
                                     docs)
    steps = len(sched.visited_steps)
    return (sched.critical_path + steps) * block * block, int(sched.computed_blocks.sum())


@pytest.mark.parametrize("mean", [128, 512, 8192])
def test_auto_on_documents_picks_the_ring_that_finishes_first_on_them(mean):
    """With segment ids, "auto" scores each layout (the per-document one too) on what its ring
    computes for those rows. The static choice (zigzag, for the causal triangle) is not the best one for short documents, which
    keep bands along the diagonal; for documents as long as the row it is the same choice."""
    S, sp, block = 8192, 4, 256
    docs = _random_documents(4, S, mean, seed=mean)
    scores = {layout: _document_key(layout, S, sp, block, docs)
              for layout in ("contiguous", "zigzag", "striped", "per_document")}
    chosen = auto_layout.resolve_layout("auto", S, sp, causal=True, block_size=block, segment_ids=docs)
    assert scores[chosen] == min(scores.values()), (chosen, scores)
    static = auto_layout.resolve_layout("auto", S, sp, causal=True, block_size=block)
    assert static == "zigzag"
    if mean == 8192:  # one document per row: the causal triangle again
        assert chosen == static
    else:
        assert scores[chosen][0] < scores[static][0], (chosen, scores)


def test_runs_of_ring_steps_and_when_a_ring_can_stop_early():
    assert tables.step_runs((0, 1, 2, 5, 6)) == [[0, 0, 3], [3, 5, 2]]
    assert tables.can_stop_early((0, 1, 2, 3))
    assert tables.can_stop_early((2, 3))  # one run that starts later
    assert not tables.can_stop_early((0,))  # one step: nothing to cut
    assert not tables.can_stop_early((0, 1, 3))  # two runs: a gap is one send, not a loop


def test_document_schedule_visits_steps_that_compute_nothing():
    """Zigzag, S = 64 on 4 devices (chunks of 8: device d holds chunks d and 7 - d), documents
    of 16 tokens, each two chunks. Chunks 0-1 and 2-3 give device d + 1's queries device d's
    keys (step 1); chunks 4-5 and 6-7 give device d's queries device d + 1's keys (step 3).
    Step 2 computes nothing, but K/V pass through it on their way to step 3."""
    spec = masks.make_mask_spec(causal=True)
    docs = np.repeat(np.arange(1, 5, dtype=np.int32), 16)[None]
    sched = tables.document_schedule(spec, "zigzag", 64, 4, 8, docs)
    assert sched.run_steps == (0, 1, 3)
    assert sched.visited_steps == (0, 1, 2, 3)


def test_ring_report_with_documents():
    """The script's document report, by hand: S = 4096 on 4 devices, blocks of 256, causal,
    documents of 512 tokens (2 blocks each: 3 kept blocks, the lower triangle), 8 documents."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(ROOT,
                          "scripts", "ring_report.py")
    out = ScriptServer.run([sys.executable, script, "--seq-len", "4096", "--sp", "4", "--block", "256",
                            "--causal", "--doc-lengths", "512", "--json",
                            "--strategies", "ring,all_gather,ulysses,usp:2"],
                           timeout=120, check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    contiguous = report["layouts"]["contiguous"]
    assert contiguous["kept_blocks"] == 24 and contiguous["computed_blocks"] == [[6]] * 4
    assert contiguous["run_steps"] == [0] and contiguous["doc_efficiency"] == 1.0
    assert report["layouts"]["zigzag"]["kept_blocks"] == 24
    # "auto" on these rows: a ring that finishes first on them; by the mask alone: zigzag
    cost = {name: r["critical_path"] + len(r["visited_steps"])
            for name, r in report["layouts"].items()}
    assert cost[report["auto_layout"]] == min(cost.values())
    assert report["auto_layout_by_the_mask"] == "zigzag"
    # each context-parallel strategy computes the same 24 kept blocks, 6 per device here
    strategies = report["strategies"]
    assert list(strategies) == ["ring", "all_gather", "ulysses", "usp:2"]
    for name, r in strategies.items():
        assert r["kept_blocks"] == r["computed_blocks"] == 24, name
        assert r["work_per_device"] == [6.0] * 4 and r["critical_path"] == 6.0, name


def test_default_block_keeps_a_zigzag_shards_halves_apart():
    """The default block of a zigzag shard divides L/2 where it can, so no block holds positions
    from both ends of the sequence (such a block is computed whole)."""
    assert masks.default_block_size(512) == 512
    assert masks.default_block_size(512, "zigzag") == 256
    assert masks.default_block_size(4096, "zigzag") == 512
    for shard_len in (512, 768, 1024, 4096):
        block = masks.default_block_size(shard_len, "zigzag")
        first, _, _ = tables.block_runs("zigzag", 4 * shard_len, 4, block)
        assert first.shape[1] == 1, (shard_len, block)  # one run per block: none straddles
    # auto compares layouts in (query, key) pairs, whatever their blocks: at L = 512 zigzag's
    # critical path is 9 blocks of 256^2 pairs, contiguous's 4 of 512^2 (counted in blocks,
    # contiguous would win).
    assert auto_layout.resolve_layout("auto", 2048, 4, causal=True) == "zigzag"
    # With the ring's block given, every layout is scored with it (the block must fit them all).
    with pytest.raises(ValueError, match="does not divide"):
        auto_layout.resolve_layout("auto", 2048, 4, causal=True, block_size=384)
