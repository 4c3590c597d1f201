"""The (dp, fsdp, sp) mesh and the logical-axis rules."""

import ml_collections
import pytest
from jax.sharding import PartitionSpec as P

from longctx import aot
from longctx import mesh as mesh_lib


def mesh_config(dp=1, fsdp=-1, sp=1):
    return ml_collections.ConfigDict(dict(dp=dp, fsdp=fsdp, sp=sp, dcn_dp=1, dcn_fsdp=1, dcn_sp=1))


def test_minus_one_fills_the_rest():
    assert mesh_lib.resolve_mesh_shape(mesh_config(dp=2, fsdp=-1, sp=2), 8) == {"dp": 2, "fsdp": 2, "sp": 2}


def test_mesh_axes_and_ring_is_innermost():
    mesh = mesh_lib.make_mesh(mesh_config(dp=1, fsdp=2, sp=4))
    assert mesh.axis_names == ("dp", "fsdp", "sp")
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 2, "sp": 4}
    # ring neighbours are consecutive devices
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1, 2, 3]


def test_logical_rules():
    assert mesh_lib.logical_to_spec(("activation_batch", "activation_length")) == P(("dp", "fsdp"), "sp")
    assert mesh_lib.logical_to_spec(("layers", "embed", "mlp")) == P(None, "fsdp", None)
    with pytest.raises(ValueError, match="no sharding rule"):
        mesh_lib.logical_to_spec(("not_an_axis",))


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
def test_multi_slice_mesh_puts_dcn_axis_across_slices():
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1", num_slices=2).devices
    config = ml_collections.ConfigDict(dict(dp=1, fsdp=2, sp=2, dcn_dp=2, dcn_fsdp=1, dcn_sp=1))
    mesh = mesh_lib.make_mesh(config, devices=devices)
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 2, "sp": 2}
    # dp crosses the data-centre network; fsdp and sp (the ring) stay inside one slice
    for dp_index in range(2):
        assert {d.slice_index for d in mesh.devices[dp_index].flat} == {dp_index}


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
@pytest.mark.parametrize("sp", [8, 16, 32])
def test_tpu_mesh_for_rings_longer_than_a_torus_axis(sp):
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4").devices
    mesh = mesh_lib.make_mesh(mesh_config(dp=1, fsdp=-1, sp=sp), devices=devices)
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 64 // sp, "sp": sp}
