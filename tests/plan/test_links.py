"""Communication priced on the links it uses: usp's pass between groups crosses
the links mesh.ring_cycle puts between device j and j + U, checked by hand and against the
lowered program; the optimizer's and the matmuls' HBM traffic as their comments count it."""

import copy
import re

import jax
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.ops import context_parallel
from longctx.parallel import mesh as mesh_lib
from longctx.plan import aot, collectives, hardware, links, planner, step_time


def test_usp_hops_by_hand_on_two_tori():
    # v5p:2x2x2 (no wrap-around at 2): the cycle visits the cube's corners one link apart; two
    # and four places on, the corners differ in two coordinates (same parity, not the same chip)
    cube = hardware.parse_topology("v5p:2x2x2")
    assert links.ring_order(cube, 8) == ((0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0),
                                         (1, 1, 0), (1, 1, 1), (1, 0, 1), (1, 0, 0))
    assert [links.pass_hops(cube, 8, u) for u in (1, 2, 4)] == [1, 2, 2]
    # v5p:4x4x4, sp = 16 on a 4x4 plane with wrap-around: the cycle (0,0) (0,1) (0,2) (0,3)
    # (1,3) (1,2) (1,1) (2,1) ...; four places on, (0,3) reaches (2,1): 2 + 2 links
    plane = hardware.parse_topology("v5p:4x4x4")
    order = links.ring_order(plane, 16)
    assert order[:8] == ((0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (2, 1))
    assert links.pass_hops(plane, 16, 1) == 1
    assert links.pass_hops(plane, 16, 2) == 2
    assert links.pass_hops(plane, 16, 4) == 4
    # every pass of the ring's own cycle is one link (mesh.ring_cycle's promise)
    for topology, sp in ((cube, 8), (plane, 16), (plane, 64)):
        extent, wrap = links.sp_box(topology, sp)
        cycle = links.ring_order(topology, sp)
        assert all(links.distance(cycle[j], cycle[(j + 1) % sp], extent, wrap) == 1 for j in range(sp))


def test_the_usp_pass_is_priced_by_its_hops():
    """The same usp step on the plane: the pass between groups costs hops x the one-link time."""
    c = copy.deepcopy(base.get_config("llama3_8b_128k"))
    topology = hardware.parse_topology("v5p:4x4x4")
    mesh = {"dp": 1, "fsdp": 4, "sp": 16}
    seconds = {}
    for u in (2, 4):
        cc = planner.candidate_config(c, mesh, planner.Strategy("usp", u), "zigzag", c.attention.residuals,
                                      c.model.remat_policy, 512)
        schedule = planner._type_schedules(cc, None, {}, {})["default"]
        est = step_time.estimate(cc, topology, schedule, mesh)
        m = cc.model
        shape = collectives.Shape(batch=1, seq_len=cc.data.seq_len, sp=16, heads=m.num_heads,
                                  kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype_bytes=2,
                                  documents=bool(cc.attention.use_segment_ids))
        parts = collectives.formula_parts("usp", shape, degree=u, steps=range(schedule.steps))
        sent = sum(p.get("permute", 0) for p in parts.values())
        one_link = m.num_layers * sent / topology.chip.ici_link_bandwidth
        seconds[u] = est.communication["cp_permute"] / one_link
    assert seconds == {2: pytest.approx(2.0), 4: pytest.approx(4.0)}


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")
def test_the_lowered_usp_pass_crosses_the_hops_the_planner_prices():
    """usp x2 and x4 over the 8 chips of v5p:2x2x2 in mesh.ring_cycle's order (as make_mesh lays
    a ring), lowered for TPU (nothing compiles): the collective-permutes' source-target pairs, as
    chip coordinates, are at most links.pass_hops apart, and the farthest is that far."""
    devices = mesh_lib.ring_cycle(list(aot.topology_devices("v5p:2x2x2")))
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    coords = [tuple(d.coords) for d in mesh.devices.flat]
    origin = np.min(coords, axis=0)
    cube = hardware.parse_topology("v5p:2x2x2")
    extent, wrap = links.sp_box(cube, 8)
    shape = collectives.Shape(batch=1, seq_len=8192, sp=8, heads=8, kv_heads=4, head_dim=128)
    spec = jax.sharding.PartitionSpec(None, "sp")
    for u in (2, 4):
        def forward(q, k, v):
            return jax.shard_map(lambda q, k, v: context_parallel.context_parallel_forward(
                q, k, v, None, strategy="usp", ulysses_degree=u, causal=True, impl="xla",
                layout="contiguous", block_sizes=512), mesh=mesh, in_specs=(spec, spec, spec),
                out_specs=(spec, spec))(q, k, v)
        arg = lambda heads: jax.ShapeDtypeStruct(  # noqa: E731
            (1, shape.seq_len, heads, shape.head_dim), jax.numpy.bfloat16,
            sharding=jax.sharding.NamedSharding(mesh, spec))
        text = collectives.lowered_hlo(jax.jit(forward).lower(arg(8), arg(4), arg(4)))
        pairs = [tuple(map(int, p)) for block in re.findall(r"source_target_pairs=\{(.*?)\}\}", text)
                 for p in re.findall(r"\{?(\d+),(\d+)", block)]
        assert pairs, "no collective-permute in the lowered usp program"
        hops = {links.distance(np.subtract(coords[a], origin), np.subtract(coords[b], origin), extent, wrap)
                for a, b in pairs}
        assert max(hops) == links.pass_hops(cube, 8, u), (u, sorted(hops))


def test_optimizer_bytes_per_parameter_are_28():
    c = base.get_config("llama3_8b_128k")
    topology = hardware.parse_topology("v5p:4x4x4")
    mesh = {"dp": 1, "fsdp": 4, "sp": 16}
    cc = planner.candidate_config(c, mesh, planner.Strategy("ring"), "zigzag", c.attention.residuals,
                                  c.model.remat_policy, 512)
    est = step_time.estimate(cc, topology, planner._type_schedules(cc, None, {}, {}), mesh)
    per_param = est.optimizer * topology.chip.hbm_bandwidth * 64 / config_lib.num_params_estimate(cc)
    assert per_param == pytest.approx(28.0) == sum(step_time.OPTIMIZER_BYTES.values())


@pytest.mark.parametrize("remat,residuals,passes", [
    ("nothing_saveable", "save_qkv", 1.0), ("dots_saveable", "save_qkv", 0.0),
    ("dots_saveable", "recompute_qkv", 1.0), ("nothing_saveable", "recompute_qkv", 1.0)])
def test_the_matmuls_hbm_passes_follow_what_is_recomputed(remat, residuals, passes):
    """recompute_qkv recomputes the layer's matmuls whatever the remat policy (model/flops.py):
    their HBM passes count it as their FLOPs do (a *_saveable policy too: 1 pass, not 3)."""
    c = copy.deepcopy(base.get_config("llama3_8b_128k"))
    c.unlock()
    c.model.remat_policy, c.attention.residuals = remat, residuals
    c.lock()
    assert step_time.recompute_passes(c) == pytest.approx(passes)
