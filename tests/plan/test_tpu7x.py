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
