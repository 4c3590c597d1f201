"""What each strategy computes for packed documents (ops/strategy_schedule.py): exactly the kept
blocks, in total, for every strategy; Ulysses balanced whatever the layout; all-gather's
critical path never longer than the ring's."""
import numpy as np
import pytest

from longctx.ops import masks, strategy_schedule, ulysses
from longctx.ops.ring import RingConfig

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
    schedules = {s: strategy_schedule.strategy_schedule(s, u, spec, layout, SEQ_LEN, SP, BLOCK, seg)
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
    schedule = strategy_schedule.strategy_schedule("usp", 2, spec, "contiguous", SEQ_LEN, 8, BLOCK,
                                                   seg, count_kept=False)
    cfg = RingConfig(spec=spec, layout="contiguous", seq_len=SEQ_LEN, sp=8, bq=BLOCK, bkv=BLOCK,
                     bkv_compute=BLOCK, bkv_dkv_compute=BLOCK, impl="xla", soft_cap=None, scale=1.0,
                     axis_name="sp", interpret=False)
    assert schedule.steps == len(ulysses.group_steps(cfg, 2)) == 2  # its own group and the one before
