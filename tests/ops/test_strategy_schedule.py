"""What each strategy computes for packed documents (ops/strategy_schedule.py): exactly the kept
blocks, in total, for every strategy; Ulysses balanced whatever the layout; all-gather's
critical path never longer than the ring's; and every (device, step) of every strategy, against
the K/V the programs' own permutations bring to that device at that step."""
import types

import jax
import numpy as np
import pytest

from longctx.ops import context_parallel, masks, ring, shard_pairs, strategy_schedule, ulysses
from longctx.ops import tables as tables_lib
from longctx.ops.ring import RingConfig
from longctx.parallel import layout as layout_lib

SEQ_LEN, SP, BLOCK = 8192, 4, 256


def _documents(seed, rows=2, mean=SEQ_LEN // 32):
    """Packed rows of documents of mean length `mean` (random lengths), natural order."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, SEQ_LEN), np.int32)
    for r in range(rows):
        cuts = rng.choice(np.arange(1, SEQ_LEN), SEQ_LEN // mean - 1, replace=False)
        starts = np.zeros(SEQ_LEN, np.int32)
        starts[0], starts[cuts] = 1, 1
        out[r] = np.cumsum(starts)
    return out


STRATEGIES = [("ring", None), ("all_gather", None), ("ulysses", None), ("usp", 2)]


@pytest.mark.parametrize("layout", ["contiguous", "striped"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, sliding_window=(512, 0)),
                                  dict(causal=True, chunk_size=1024)], ids=["causal", "window", "chunked"])
def test_every_strategy_computes_exactly_the_kept_blocks(layout, mask):
    spec = masks.make_mask_spec(**mask)
    seg = _documents(seed=len(layout))
    schedules = {s: strategy_schedule.strategy_schedule(context_parallel.named(s, u), spec, layout,
                                                     SEQ_LEN, SP, BLOCK, seg)
                 for s, u in STRATEGIES}
    kept = schedules["ring"].kept_blocks
    assert kept > 0
    for name, schedule in schedules.items():
        assert schedule.kept_blocks == kept
        assert schedule.computed_blocks == pytest.approx(kept), name
    # Ulysses: every device computes every pair for its heads, so all are equally busy
    ulysses_work = schedules["ulysses"].work
    assert np.allclose(ulysses_work, ulysses_work[0])
    assert schedules["ulysses"].efficiency == pytest.approx(1.0)
    # the gather removes the ring's per-step waits: never a longer critical path
    assert schedules["all_gather"].critical_path <= schedules["ring"].critical_path


def test_usp_visits_the_group_steps_its_ring_runs():
    """The report's steps are the ones ulysses.group_steps makes the program visit."""
    spec = masks.make_mask_spec(causal=True, sliding_window=(300, 0))
    seg = np.ones((1, SEQ_LEN), np.int32)
    schedule = strategy_schedule.strategy_schedule(context_parallel.named("usp", 2), spec, "contiguous",
                                                   SEQ_LEN, 8, BLOCK, seg, count_kept=False)
    cfg = RingConfig(spec=spec, layout="contiguous", seq_len=SEQ_LEN, sp=8, bq=BLOCK, bkv=BLOCK,
                     bkv_compute=BLOCK, bkv_dkv_compute=BLOCK, impl="xla", soft_cap=None, scale=1.0,
                     axis_name="sp", interpret=False)
    assert schedule.steps == len(ulysses.group_steps(cfg, 2)) == 2  # its own group and the one before


# ----------------------------------------------------------------------------- each (device, step)
# The schedule's index transforms ([device, ring step] -> [query shard, K/V shard]: by_pair; a
# group's K/V at a group step: usp) keep every total whatever their direction, so a total cannot
# test them. These tests check every (device, step) entry against an independent count: the
# K/V shards travel by the very permutations the programs send them with (ring._shift,
# ulysses._Groups.shift, with lax.ppermute read as what it does to a global view, no compile),
# and a pair's blocks are counted from the mask's element-wise verdict on the layout's positions.

def _ppermute_on_global_view(x, axis_name, perm):
    """What lax.ppermute does, on x [device, ...] holding every device's value: the value of
    source j lands on destination k for each (j, k) in perm; a device nothing reaches holds -1."""
    out = np.full_like(x, -1)
    for source, destination in perm:
        out[destination] = x[source]
    return out


def _holders(monkeypatch, strategy, degree, sp, steps):
    """int [step, device]: the K/V shard (ring) or the group of K/V shards (usp) device d holds
    after the program's first `steps` sends, each one step on."""
    monkeypatch.setattr(jax.lax, "ppermute", _ppermute_on_global_view)
    cfg = types.SimpleNamespace(sp=sp, axis_name="sp")
    if strategy == "ring":
        held, send = np.arange(sp), lambda x: ring._shift(x, 1, cfg)
    else:
        groups = object.__new__(ulysses._Groups)  # its __init__ reads the device's axis index
        groups.cfg, groups.degree, groups.count = cfg, degree, sp // degree
        held, send = np.arange(sp) // degree, lambda x: groups.shift(x, 1)
    out = []
    for _ in range(steps):
        out.append(held)
        held = send(held)
    return np.stack(out)


def _pair_blocks(spec, layout, seq_len, sp, block):
    """int [query shard, K/V shard]: blocks holding a pair the mask allows, element-wise."""
    pos = layout_lib.shard_positions(layout, seq_len, sp).astype(np.int64)
    allowed = spec.allowed(pos[:, None, :, None], pos[None, :, None, :])  # [a, c, L, L]
    n = pos.shape[1] // block
    return allowed.reshape(sp, sp, n, block, n, block).any(axis=(3, 5)).sum(axis=(2, 3))


def _expected_step_work(monkeypatch, strategy, degree, pairs):
    """float [device, step] from the blocks of every (query shard, K/V shard) pair: what each
    device holds at each step (by the programs' permutations), what it computes of it."""
    sp = pairs.shape[0]
    if strategy == "ring":
        held = _holders(monkeypatch, "ring", None, sp, sp)
        return np.array([[pairs[d, held[s, d]] for s in range(sp)] for d in range(sp)], float)
    if strategy == "all_gather":  # every K/V shard, once
        return pairs.sum(axis=1, keepdims=True).astype(float)
    if strategy == "ulysses":     # every pair, for 1/sp of the heads
        return np.full((sp, 1), pairs.sum() / sp)
    held = _holders(monkeypatch, "usp", degree, sp, sp // degree)
    shards = lambda g: slice(g * degree, (g + 1) * degree)  # noqa: E731
    return np.array([[pairs[shards(d // degree), shards(held[t, d])].sum() / degree
                      for t in range(len(held))] for d in range(sp)])


def _check_every_strategy(monkeypatch, per_step, pairs, static, sp):
    """Each strategy's step_work, work and critical path from `per_step` [device, ring step]
    against the counts from `pairs` [query shard, K/V shard]; usp's group steps against `static`."""
    for name, degree in [("ring", None), ("all_gather", None), ("ulysses", None),
                         ("usp", 2), ("usp", 4)]:
        schedule = context_parallel.named(name, degree).from_step_blocks(per_step, 0.0, None, sp, static)
        expected = _expected_step_work(monkeypatch, name, degree, pairs)
        np.testing.assert_array_equal(schedule.step_work, expected, err_msg=f"{name}:{degree}")
        np.testing.assert_array_equal(schedule.work, expected.sum(axis=1))
        if name != "ring":  # the ring's critical path is given (it depends on where it stops)
            assert schedule.critical_path == expected.max(axis=0).sum(), f"{name}:{degree}"


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, sliding_window=(200, 0))],
                         ids=["causal", "window"])
def test_each_device_and_step_against_the_ring_permutation(monkeypatch, layout, mask):
    """The ring's own per-step blocks (tables.block_classes), through each strategy's schedule,
    give every device at every step the blocks the K/V it holds there have with its queries."""
    spec, sp, seq_len, block = masks.make_mask_spec(**mask), 8, 2048, 64
    pairs = _pair_blocks(spec, layout, seq_len, sp, block)
    classes = tables_lib.block_classes(spec, layout, seq_len, sp, block, block)
    per_step = (classes > 0).sum(axis=(2, 3))
    static = shard_pairs.static_pairs(spec, layout, seq_len, sp, block, block)
    np.testing.assert_array_equal(static, pairs > 0)
    np.testing.assert_array_equal(strategy_schedule.by_pair(per_step), pairs)
    _check_every_strategy(monkeypatch, per_step, pairs, static, sp)


def test_each_device_and_step_of_arbitrary_ring_blocks(monkeypatch):
    """Blocks with no symmetry at all (every entry distinct): a transform in the wrong direction
    cannot land on an equal value by chance."""
    sp = 8
    per_step = np.random.default_rng(0).permutation(sp * sp).reshape(sp, sp) + 1
    held = _holders(monkeypatch, "ring", None, sp, sp)
    pairs = np.zeros_like(per_step)
    for s in range(sp):
        pairs[np.arange(sp), held[s]] = per_step[:, s]
    np.testing.assert_array_equal(strategy_schedule.by_pair(per_step), pairs)
    _check_every_strategy(monkeypatch, per_step, pairs, pairs > 0, sp)


@pytest.mark.parametrize("degree", [2, 4])
def test_usp_group_steps_are_those_whose_held_pairs_the_mask_keeps(monkeypatch, degree):
    """ulysses.steps_with_pairs against the groups each device holds at each group step: a
    window reaches the group before, one send on (at U = 2, a count of steps cannot tell it from
    the group after, sp/U - 1 = 3 sends on)."""
    spec = masks.make_mask_spec(causal=True, sliding_window=(100, 0))
    sp, seq_len, block = 8, 2048, 64
    pairs = _pair_blocks(spec, "contiguous", seq_len, sp, block)
    held = _holders(monkeypatch, "usp", degree, sp, sp // degree)
    shards = lambda g: slice(g * degree, (g + 1) * degree)  # noqa: E731
    expected = tuple(t for t in range(len(held)) if any(
        pairs[shards(d // degree), shards(held[t, d])].any() for d in range(sp)))
    assert expected == (0, 1)
    static = shard_pairs.static_pairs(spec, "contiguous", seq_len, sp, block, block)
    assert ulysses.steps_with_pairs(static, degree) == expected
