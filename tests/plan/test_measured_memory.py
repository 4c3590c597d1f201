"""A step fits a measured TPU chip when the compiler's test passes (temporaries within HBM) and
the runtime's peak does (state and batch plus the measured share of the temporaries); a chip not
measured keeps the compiler's whole figure (plan/measured_memory.py)."""
import dataclasses

import pytest

from longctx.plan import aot, hardware, measured_memory, memory_model, planner
from tests.plan.test_planner import _config

GIB = 1024 ** 3
V5E = "TPU v5 lite"


def _step(device_kind, state_gib, temp_gib, oom=False):
    state = int(state_gib * GIB)
    return aot.CompiledStep(topology="t", device_kind=device_kind, num_devices=1,
                            mesh_shape={"dp": 1, "fsdp": 1, "sp": 1}, argument_bytes=state,
                            output_bytes=state, alias_bytes=state, temp_bytes=int(temp_gib * GIB),
                            compile_seconds=1.0, oom_at_compile=oom)


def test_the_share_is_fitted_and_predicts_the_held_out_peaks_within_10_percent():
    points = measured_memory.POINTS[V5E]
    share = measured_memory.program_share(V5E)
    assert share == max(p.share for p in points if p.fit) < 1
    errors = measured_memory.held_out_errors(V5E)
    assert len(errors) == sum(not p.fit for p in points) >= 3
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
    assert measured_memory.program_share("TPU v5") is None  # v5p: not measured


def test_the_chips_verdicts_on_the_runs_measured():
    """The v5e_0p5b step at 32,768 tokens (AOT: 5.72 GiB of state and batch, 11.99 GiB of
    temporaries) ran on the chip; 4 micro-batches (16.55 GiB of temporaries) and 65,536 tokens
    (20.50) were refused by its compiler."""
    ran = _step(V5E, 5.72, 11.99)
    assert ran.total_bytes > 15.75 * GIB and ran.fits
    assert ran.peak_bytes == pytest.approx((5.72 + measured_memory.program_share(V5E) * 11.99) * GIB,
                                           rel=1e-6)
    assert ran.peak_bytes / GIB == pytest.approx(5.75 + 8.56, rel=0.10)  # the chip's peak
    assert not _step(V5E, 5.72, 16.55).fits  # the compiler's test: temporaries over HBM
    assert not _step(V5E, 5.72, 20.50).fits
    assert not _step(V5E, 11.0, 9.0).fits  # temporaries fit, the peak does not


def test_a_chip_not_measured_keeps_the_compilers_figure():
    step = _step("TPU v5", 60.0, 40.0)  # v5p: 95 GiB
    assert step.peak_bytes == step.total_bytes
    assert step.fits is False and _step("TPU v5", 50.0, 40.0).fits


def test_the_report_says_the_run_time_figure_and_why():
    config = _config("tiny", data=dict(seq_len=32768, global_batch_size=1))
    text = aot.format_report(config, _step(V5E, 5.72, 11.99))
    assert "at run time" in text and "fits         yes" in text
    text = aot.format_report(config, _step(V5E, 5.72, 16.55))
    assert "fits         NO" in text and "the temporaries alone are over it" in text
    assert "at run time" not in aot.format_report(config, _step("TPU v5", 5.72, 11.99))


def test_the_memory_model_holds_the_same_rule():
    """The planner's model: the larger of the runtime's hold and the temporaries alone."""
    m = memory_model.MemoryEstimate(state_bytes=6 * GIB, gradient_bytes=2 * GIB, saved_bytes=5 * GIB,
                                    working_bytes=3 * GIB, scale=1.0)
    assert m.held_bytes(None) == m.total_bytes == 16 * GIB
    assert m.held_bytes(0.5) == 11 * GIB  # 6 + 0.5 x 10
    small_state = dataclasses.replace(m, state_bytes=GIB)
    assert small_state.held_bytes(0.5) == 10 * GIB  # the temporaries alone: over 1 + 0.5 x 10


def test_the_planner_finds_the_v5e_preset_a_run_that_fits_one_chip():
    """On one v5e chip the preset at 32,768 tokens ran (docs/tpu.md); by the compiler's whole
    figure no candidate fit."""
    config = _config("v5e_0p5b")
    topology = hardware.parse_topology("v5e:1x1")
    need = planner.smallest_memory(config, topology)
    assert need <= planner.HBM_HEADROOM * topology.device.hbm_bytes
    assert topology.device.program_share == measured_memory.program_share(V5E)
    assert hardware.parse_topology("v5p:2x2x1").device.program_share is None
