"""The (dp, fsdp, sp) mesh and the logical-axis rules."""

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longctx import errors
from longctx.parallel import mesh as mesh_lib
from longctx.plan import aot


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
    assert mesh_lib.logical_to_spec(("layers", "embed", "mlp")) == P(None, ("fsdp", "sp"), None)
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


# ----------------------------------------------------------------------------- ring hops on TPU tori


def _wraparound(devices) -> tuple[bool, ...]:
    """Which physical axes of a slice have wrap-around links (Cloud TPU docs): v4 and v5p slices of
    one 4x4x4 cube or more (every axis a multiple of 4) are full 3D tori, smaller ones are meshes;
    v5e and v6e have wrap-around only along an axis that spans the whole 16x16 pod."""
    bounds = tuple(max(d.coords[i] for d in devices) + 1 for i in range(3))
    if "lite" in devices[0].device_kind:  # v5e ("TPU v5 lite"), v6e ("TPU v6 lite")
        return tuple(b == 16 for b in bounds)
    cube = all(b % 4 == 0 for b in bounds)
    return (cube,) * 3


def _hops(a, b, bounds, wrap) -> int:
    """ICI hops between the chips of two devices (0 for two cores of one chip)."""
    total = 0
    for x, y, n, w in zip(a.coords, b.coords, bounds, wrap):
        d = abs(x - y)
        total += min(d, n - d) if w else d
    return total


def ring_hops(mesh) -> list[int]:
    """Hops between consecutive devices of every sp ring, the last back to the first included."""
    devices = list(mesh.devices.flat)
    bounds = tuple(max(d.coords[i] for d in devices) + 1 for i in range(3))
    wrap = _wraparound(devices)
    rings = mesh.devices.reshape(-1, mesh.shape["sp"])
    return [_hops(r[i], r[(i + 1) % len(r)], bounds, wrap) for r in rings for i in range(len(r))]


def _tpu_mesh(topology, preset=None, sp=None):
    from jax.experimental import topologies

    from configs import base

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    config = base.get_config(preset).mesh if preset else mesh_config(dp=1, fsdp=-1, sp=sp)
    return mesh_lib.make_mesh(config, devices=devices)


# (topology, preset or None, sp): in every case the torus has a ring of sp chips with every hop 1 (an
# axis with wrap-around, or a block of 2+ axes with an even side).
RING_CASES = [
    # sp along one physical axis that has wrap-around
    pytest.param("v5p:4x4x4", None, 4, id="v5p4x4x4-sp4"),
    pytest.param("v6e:16x16", "llama3_8b_128k", None, id="llama3_8b_128k-v6e16x16"),  # shipped: sp=16
    pytest.param("v5e:16x16", "llama3_8b_128k", None, id="llama3_8b_128k-v5e16x16"),  # shipped: sp=16
    pytest.param("v6e:4x4", None, 16, id="v6e4x4-sp16"),  # no wrap-around; a cycle through the 4x4
    pytest.param("v5p:2x2x1", None, 2, id="v5p2x2x1-sp2"),
    # rings longer than a torus axis: over a plane or a block, which jax's builder lays out row by
    # row (worst hop 2, 3 across the planes of a 4x4x2 block; a 2x2 square in Z order)
    pytest.param("v5p:4x4x4", "llama3_8b_128k", None, id="llama3_8b_128k-v5p4x4x4"),  # shipped: sp=16
    pytest.param("v5p:4x4x4", None, 8, id="v5p4x4x4-sp8"),
    pytest.param("v5p:4x4x4", None, 32, id="v5p4x4x4-sp32"),
    pytest.param("v5p:2x2x2", "tiny", None, id="tiny-v5p2x2x2"),  # sp=4 over a 2x2 square
]


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
@pytest.mark.parametrize("topology,preset,sp", RING_CASES)
def test_ring_neighbours_are_one_ici_hop_apart(topology, preset, sp):
    """Every K/V pass of the ring (wrap-around included) crosses one ICI link where the torus allows
    it, measured on device coordinates, not only the mesh shape."""
    mesh = _tpu_mesh(topology, preset, sp)
    hops = ring_hops(mesh)
    assert len(hops) == mesh.devices.size
    assert max(hops) == 1, (f"{topology} mesh {dict(mesh.shape)}: worst ring hop {max(hops)}, hops per pass "
                            f"{ {h: hops.count(h) for h in sorted(set(hops))} }")


def test_ring_hops_count_wraparound_and_chips():
    """The hop measure itself, on stand-in devices: wrap-around links only where the slice has them."""
    from types import SimpleNamespace as D

    cube = [D(coords=(x, y, z), device_kind="TPU v5") for x in range(4) for y in range(4) for z in range(4)]
    small = [D(coords=(x, y, z), device_kind="TPU v5") for x in range(2) for y in range(4) for z in range(4)]
    lite = [D(coords=(x, y, 0), device_kind="TPU v6 lite") for x in range(16) for y in range(4)]
    assert _wraparound(cube) == (True, True, True) and _wraparound(small) == (False, False, False)
    assert _wraparound(lite) == (True, False, False)
    a, b = D(coords=(0, 0, 0)), D(coords=(3, 1, 0))
    assert _hops(a, b, (4, 4, 4), (True,) * 3) == 2 and _hops(a, b, (4, 4, 4), (False,) * 3) == 4
    assert _hops(a, D(coords=(0, 0, 0)), (4, 4, 4), (True,) * 3) == 0  # two cores of one chip

    class Rings:  # 16 rings of 4 along z (the stand-in cube is ordered x, y, z, z fastest)
        shape = {"sp": 4}
        devices = np.array(cube, dtype=object).reshape(16, 4)

    assert ring_hops(Rings) == [1] * 64  # z = 0..3, then back to 0 over the wrap-around link
    Rings.devices = Rings.devices[:, [0, 2, 1, 3]]
    assert ring_hops(Rings) == [2, 1, 2, 1] * 16
    Rings.devices = np.array(small, dtype=object).reshape(8, 4)
    assert ring_hops(Rings) == [1, 1, 1, 3] * 8  # no wrap-around link: back across the axis


@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed")
@pytest.mark.parametrize("sp", [8, 16, 32])
def test_tpu_mesh_for_rings_longer_than_a_torus_axis(sp):
    mesh = _tpu_mesh("v5p:4x4x4", sp=sp)
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 64 // sp, "sp": sp}
    assert ring_hops(mesh) == [1] * 64
    # only the order along sp changed: every ring holds the chips the builder gave it
    from jax.experimental import mesh_utils, topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4").devices
    built = mesh_utils.create_device_mesh((1, 64 // sp, sp), devices=devices,
                                          allow_split_physical_axes=True)
    assert [{d.id for d in r} for r in mesh.devices.reshape(-1, sp)] == \
        [{d.id for d in r} for r in built.reshape(-1, sp)]


def _cycle_hops(cells):
    return [sum(abs(a - b) for a, b in zip(cells[i], cells[(i + 1) % len(cells)]))
            for i in range(len(cells))]


@pytest.mark.parametrize("extent", [(2, 2, 1), (4, 4, 1), (1, 4, 4), (4, 4, 2), (3, 4, 1), (2, 3, 3),
                                    (16, 16, 1), (2, 2, 2)])
def test_box_cycle_visits_every_cell_once_one_step_at_a_time(extent):
    import itertools

    cells = mesh_lib.box_cycle(extent)
    assert sorted(cells) == sorted(itertools.product(*(range(n) for n in extent)))
    assert _cycle_hops(cells) == [1] * len(cells)


@pytest.mark.parametrize("extent", [(1, 1, 1), (4, 1, 1), (1, 1, 16), (3, 3, 1), (3, 5, 3)])
def test_box_cycle_is_none_for_a_line_or_an_odd_box(extent):
    assert mesh_lib.box_cycle(extent) is None


def test_ring_cycle_reorders_whole_boxes_only():
    from types import SimpleNamespace as D

    def ring(coords):
        return [D(coords=c, id=i) for i, c in enumerate(coords)]

    z_order = ring([(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)])  # a diagonal step from 2nd to 3rd
    cycle = mesh_lib.ring_cycle(z_order)
    assert sorted(d.id for d in cycle) == [0, 1, 2, 3]
    assert _cycle_hops([d.coords for d in cycle]) == [1, 1, 1, 1]
    shifted = ring([(2, 4, 1), (3, 4, 1), (2, 5, 1), (3, 5, 1)])  # a translate: the same pattern
    assert [d.id for d in mesh_lib.ring_cycle(shifted)] == [d.id for d in cycle]
    line = ring([(0, 0, z) for z in range(4)])
    not_a_box = ring([(0, 0, 0), (1, 0, 0), (2, 1, 0), (3, 1, 0)])
    two_cores = ring([(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)])
    for kept in (line, not_a_box, two_cores):
        assert mesh_lib.ring_cycle(kept) == kept


# ----------------------------------------------------------------------------- distributed start-up


class _FakeInitialize:
    """jax.distributed.initialize as a TPU VM without a metadata server answers it: auto-detection
    asks metadata.google.internal for the pod's hosts and fails."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise ConnectionError("Failed to establish a new connection to metadata.google.internal")


@pytest.fixture
def fake_tpu_host(monkeypatch):
    """A single TPU v5e VM's start-up environment, with jax.distributed faked."""
    for name in ("LONGCTX_COORDINATOR", "LONGCTX_NUM_PROCESSES", "LONGCTX_PROCESS_ID",
                 "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "true")
    initialize = _FakeInitialize()
    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return initialize


def _settings():
    return ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                          local_device_count=0))


@pytest.mark.parametrize("hosts", ["localhost", "t1v-n-0a1b2c3d-w-0", None])
def test_one_host_is_one_process(fake_tpu_host, monkeypatch, hosts):
    """TPU_WORKER_HOSTNAMES=localhost (a single TPU VM), one named host, or none: no jax.distributed."""
    if hosts is not None:
        monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hosts)
    mesh_lib.maybe_initialize_distributed(_settings())
    assert fake_tpu_host.calls == 0


def test_several_hosts_start_jax_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.delenv("LONGCTX_COORDINATOR", raising=False)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2, 10.0.0.3")
    mesh_lib.maybe_initialize_distributed(_settings())
    assert calls == [((), {})]  # auto-detected: nothing passed


def test_a_pod_that_cannot_start_says_which_variable_to_set(fake_tpu_host, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.2,10.0.0.3")
    with pytest.raises(errors.ConfigError) as raised:
        mesh_lib.maybe_initialize_distributed(_settings())
    assert fake_tpu_host.calls == 1
    message = str(raised.value)
    assert "\n" not in message and message.count(". ") == 0, message
    assert message.startswith("jax.distributed could not start (ConnectionError: Failed to establish a new "
                              "connection to metadata.google.internal); it was started because "
                              "TPU_WORKER_HOSTNAMES names 2 hosts (10.0.0.2, 10.0.0.3): on a single host unset it")
    assert "set LONGCTX_COORDINATOR=HOST:PORT" in message
