"""The attention kernel's efficiency as a function of the work per call (plan/step_time.py,
kernel_efficiency), and what the calibration reports by sequence length."""

import copy
import json
import os

import pytest

from configs import base
from longctx.plan import calibration, hardware, planner, step_time

V5P = hardware.parse_topology("v5p:4x4x4").chip


def _call(shard: int, block: int, heads: int = 32, head_dim: int = 128, kv: int | None = None):
    """(FLOPs, grid steps) of one forward call: a query shard against a K/V shard, all blocks."""
    kv = shard if kv is None else kv
    blocks = (shard // block) * (kv // block)
    return 4.0 * block * block * head_dim * heads * blocks, blocks * heads


def test_efficiency_grows_with_the_work_per_call_and_is_bounded():
    c = step_time.CONSTANTS
    previous = 0.0
    for shard in (1024, 2048, 8192, 32_768, 131_072):  # longer shards, the block fixed
        e = step_time.kernel_efficiency(V5P.peak_flops, *_call(shard, 512))
        assert previous <= e <= c["attention"] <= 1.0
        previous = e
    previous = 0.0
    for block in (128, 256, 512, 1024, 2048):  # larger blocks: the step's fixed cost over more FLOPs
        e = step_time.kernel_efficiency(V5P.peak_flops, *_call(8192, block))
        assert previous < e <= c["attention"]
        previous = e
    # fixed costs paid, the block matmuls' own efficiency; none of them, none of the work
    assert step_time.kernel_efficiency(V5P.peak_flops, 1e30, 1.0) == pytest.approx(c["attention"])
    assert step_time.kernel_efficiency(V5P.peak_flops, 1e9, 1e6, constants={
        "block_overhead": 1e9}) < 1e-3
    # a grid step's cost is in FLOPs at peak: a chip twice as fast pays the same share
    flops, steps = _call(8192, 512)
    assert step_time.kernel_efficiency(2 * V5P.peak_flops, flops, steps, constants={"call_overhead": 0.0}) == \
        pytest.approx(step_time.kernel_efficiency(V5P.peak_flops, flops, steps, constants={"call_overhead": 0.0}))


def test_the_step_prices_attention_by_the_efficiency_of_its_calls():
    """The 8B preset's ring at 131,072 tokens over sp=16: per FLOP its kernels compute, a larger
    block's attention is cheaper (the grid steps' fixed cost spread over more FLOPs), and the
    seconds are those of kernel_efficiency over the ring's calls."""
    c = base.get_config("llama3_8b_128k")
    topology = hardware.parse_topology("v5p:4x4x4")
    mesh = {"dp": 1, "fsdp": 4, "sp": 16}
    m = c.model
    per_flop = {}
    for block in (512, 1024, 2048):
        cc = planner.candidate_config(c, mesh, planner.Strategy("ring"), "zigzag", c.attention.residuals,
                                      m.remat_policy, block)
        schedule = planner._type_schedules(cc, None, {}, {})["default"]
        s = step_time.estimate(cc, topology, schedule, mesh)
        rows = c.data.global_batch_size // 4
        flops = schedule.critical_path * rows * 4.0 * block * block * m.head_dim * m.num_heads
        # the grid steps walked with no live block: the forward's and dQ's rows, dK/dV's columns
        dead = {"forward": schedule.dead_rows, "backward": schedule.dead_rows + schedule.dead_columns}
        want = 0.0
        for p, w in step_time.ATTENTION_PASSES.items():
            k = step_time.KERNELS_PER_PASS[p]
            call = flops * w / schedule.steps
            e = step_time.kernel_efficiency(topology.chip.peak_flops, call,
                                            k * flops / schedule.steps / (4.0 * block * block * m.head_dim),
                                            k, dead_steps=dead[p] * rows * m.num_heads / schedule.steps)
            want += m.num_layers * schedule.steps * call / (topology.chip.peak_flops * e)
        assert s.attention == pytest.approx(want, rel=1e-9)
        per_flop[block] = s.attention / (flops * sum(step_time.ATTENTION_PASSES.values()))
    assert per_flop[2048] < per_flop[1024] < per_flop[512]


def test_the_calibration_reports_every_length_range_with_held_out_points():
    """Each range of sequence length with published points has held-out points among them (the
    error the docs report there is not the fit's), and the ranges cover every point."""
    ranges = calibration.LENGTH_RANGES
    for p in calibration.POINTS:
        assert sum(lo <= p.seq_len <= hi for lo, hi in ranges.values()) <= 1
    for name, (lo, hi) in ranges.items():
        inside = [p for p in calibration.POINTS if lo <= p.seq_len <= hi]
        if inside:
            assert any(not p.fit for p in inside), name
    assert sum(p.fit for p in calibration.POINTS) == len(calibration.FIT)


def test_vector_work_bounds_narrow_heads_on_v5e_and_nothing_on_a_chip_without_its_cost():
    """A score element's vector work runs beside the MXUs (max, not a sum), on the chips with a
    fitted cost (v5e from its kernel timings): on v5e a call of the same score elements takes
    the same time in heads of 64 as of 128 (as the chip measured: 59.8 against 59.3 ms), and
    heads of 256 reach more of peak; on v5p (no such cost) the head width changes nothing."""
    v5e = hardware.parse_topology("v5e:1x1").device
    assert step_time.CONSTANTS["score_element_v5e"] > 0
    seconds = {}
    for width in (64, 128, 256):
        flops, steps = _call(32_768, 1024, heads=8, head_dim=width)
        e = step_time.kernel_efficiency(v5e.peak_flops, flops, steps, head_dim=width, chip="v5e")
        seconds[width] = flops / (v5e.peak_flops * e)
        assert e <= step_time.CONSTANTS["attention_v5e"]
    assert seconds[64] == pytest.approx(seconds[128], rel=0.05)
    assert seconds[256] > 1.3 * seconds[128]
    flops, steps = _call(32_768, 2048, heads=16, head_dim=256)
    assert step_time.kernel_efficiency(V5P.peak_flops, flops, steps, head_dim=128, chip="v5p") == \
        pytest.approx(step_time.kernel_efficiency(V5P.peak_flops, flops, steps, head_dim=256, chip="v5p"))
    # still growing with the work per call on v5e, and bounded
    previous = 0.0
    for shard in (2048, 8192, 32_768, 131_072):
        e = step_time.kernel_efficiency(v5e.peak_flops, *_call(shard, 1024, heads=16, head_dim=256),
                                        head_dim=256, chip="v5e")
        assert previous <= e <= step_time.CONSTANTS["attention_v5e"]
        previous = e


def test_the_long_end_is_held_out_and_within_a_quarter():
    """The bar: at least 3 published points at 512K tokens or more, held out of the fit,
    and the held-out mean absolute error there (docs/planner_calibration.json, which
    test_planner checks is the fit of today's constants) at most 25%."""
    long = [p for p in calibration.POINTS if p.seq_len >= 524_288 and not p.fit]
    assert len(long) >= 3
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "planner_calibration.json")) as f:
        rows = json.load(f)["step_time"]["rows"]
    errors = [abs(r["error"]) for r in rows if r["seq_len"] >= 524_288 and not r["fit"]]
    assert len(errors) == len(long)
    assert sum(errors) / len(errors) <= 0.25


def test_a_measured_chips_own_constants_price_that_chip_only():
    """chip_constant: v5e's own figure on v5e, the published runs' on every other chip (0 for a
    cost with no shared figure); so the v5e chip's constants move no published point."""
    c = step_time.CONSTANTS
    assert step_time.chip_constant("attention", "v5e") == c["attention_v5e"]
    assert step_time.chip_constant("attention", "v5p") == c["attention"]
    assert step_time.chip_constant("score_element", "v5p") == 0.0
    assert step_time.matmul_efficiency("v6e") == c["matmul"]
    others = {k: 2 * v if k.endswith("_v5e") else v for k, v in c.items()}
    point = next(p for p in calibration.POINTS if p.fit and p.mesh[2] > 1)
    config = base.get_config("")
    assert calibration.predict(config, point, others).seconds == calibration.predict(config, point).seconds
