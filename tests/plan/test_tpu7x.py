"""TPU v7x (Ironwood, "tpu7x" to libtpu): the chip in the planner's table, how jax's devices map to
its chips, and a train step compiled for it ahead of time."""
import os

import pytest

from longctx.plan import aot, hardware


def test_a_tpu7x_chip_is_two_devices_each_with_half_of_it():
    topology = hardware.parse_topology("tpu7x:4x4x4")
    assert (topology.num_chips, topology.num_devices) == (64, 128)
    device, chip = topology.device, topology.chip
    assert device.peak_flops * 2 == chip.peak_flops == 2307e12
    assert device.hbm_bytes * 2 == chip.hbm_bytes == 192 * hardware.GIB
    assert device.hbm_bandwidth * 2 == chip.hbm_bandwidth
    # every other chip is one device: its per-device view is itself
    v5p = hardware.parse_topology("v5p:4x4x4")
    assert v5p.device is v5p.chip and v5p.num_devices == v5p.num_chips == 64
    assert hardware.chip_for_device_kind("TPU7x") is chip


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")
def test_libtpu_gives_two_devices_per_tpu7x_chip_as_the_table_says():
    devices = aot.topology_devices("tpu7x:2x2x1")
    assert {d.device_kind for d in devices} == {"TPU7x"}
    assert len(devices) == hardware.parse_topology("tpu7x:2x2x1").num_devices == 8
    assert len({tuple(d.coords) for d in devices}) == 4 and aot.cores_per_chip(devices) == 2
    assert sorted(d.core_on_chip for d in devices) == [0] * 4 + [1] * 4


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")
@pytest.mark.skipif(not os.environ.get("LONGCTX_EXHAUSTIVE"),
                    reason="a minute of compile: with LONGCTX_EXHAUSTIVE=1 (the ring alone compiles for "
                    "tpu7x in tests/ops/test_cp_tpu_aot.py)")
def test_the_tiny_train_step_compiles_for_tpu7x_at_65536_tokens():
    from configs import base

    config = base.get_config("tiny")
    config.mesh.update(dp=1, fsdp=1, sp=8)
    config.data.update(seq_len=65536, global_batch_size=1)
    result = aot.compile_train_step(config, "tpu7x:2x2x1")
    assert result.device_kind == "TPU7x" and result.num_devices == 8 and result.cores_per_chip == 2
    assert result.hbm_bytes == 96 * hardware.GIB  # half of a chip's 192 GiB
    assert result.fits and 0 < result.total_bytes < result.hbm_bytes


def test_the_planner_lays_its_meshes_over_tpu7x_devices_not_chips():
    """tpu7x:2x2x1 is 4 chips and 8 devices: every mesh the planner prices has 8 devices, each
    with a device's HBM (96 GiB, not the chip's 192) and its peak."""
    from configs import base
    from longctx.plan import planner

    config = base.get_config("tiny")
    config.data.update(seq_len=8192, global_batch_size=1)
    topology = hardware.parse_topology("tpu7x:2x2x1")
    rows = planner.plan(config, topology)
    assert rows and all(r.mesh["dp"] * r.mesh["fsdp"] * r.mesh["sp"] == 8 for r in rows)
    assert {r.hbm_bytes for r in rows} == {96 * hardware.GIB}
    assert rows[0].step.num_chips == 8 and rows[0].step.peak_flops == 1153.5e12


def test_the_two_devices_of_a_tpu7x_chip_take_no_torus_axis():
    """sp over 8 devices of tpu7x:2x2x1 spans the 4 chips' two axes, as sp = 4 of v5p:2x2x1 does;
    a usp pass between the two devices of one chip crosses no link (priced as one)."""
    from longctx.plan import links

    order = ("sp", "fsdp", "dp")
    tpu7x, v5p = hardware.parse_topology("tpu7x:2x2x1"), hardware.parse_topology("v5p:2x2x1")
    assert hardware.axis_links(tpu7x, {"sp": 8, "fsdp": 1, "dp": 1}, order) == \
        hardware.axis_links(v5p, {"sp": 4, "fsdp": 1, "dp": 1}, order)
    assert hardware.axis_links(tpu7x, {"sp": 2, "fsdp": 4, "dp": 1}, order)["sp"] == 0.0
    assert links.pass_hops(tpu7x, 8, 1) == 1
    assert links.pass_hops(tpu7x, 8, 2) == links.pass_hops(v5p, 4, 1)
