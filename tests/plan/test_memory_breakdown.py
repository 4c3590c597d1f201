"""memory.MemoryBreakdown: what a compiled step's per-device bytes hold, against independent counts.

The tiny config is compiled for a v5p:2x2x2 topology through libtpu (nothing runs); the state's
per-device bytes are recounted here by hand from each leaf's PartitionSpec and the mesh's axis
sizes, and one layer's saved activations are measured at three sequence lengths.
"""

import dataclasses
import math

import jax
import pytest

from configs import base
from longctx import config as config_lib
from longctx.parallel import mesh as mesh_lib
from longctx.plan import aot, memory
from longctx.train import state as train_state
from longctx.train import steps as train_steps

pytestmark = [pytest.mark.tpu_aot,
              pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")]

TOPOLOGY = "v5p:2x2x2"


def _tiny(seq_len: int = 1024):
    c = base.get_config("tiny")
    c.unlock()
    c.data.seq_len = seq_len
    return c


def _setup(c):
    devices = aot.topology_devices(TOPOLOGY)
    sizes = config_lib.validate(c, num_devices=len(devices))
    mesh = mesh_lib.make_mesh(c.mesh, devices=devices)
    layout = train_state.resolve_layout(c, sizes[mesh_lib.SP])
    with jax.default_device(jax.devices("cpu")[0]):
        return mesh, layout, train_state.make_setup(c, mesh, layout)


def _bytes_by_hand(abstract, shardings, mesh_shape) -> int:
    """Per-device bytes: every dimension divided by the sizes of the mesh axes its spec names."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        dims = list(leaf.shape)
        for i, entry in enumerate(sharding.spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            split = math.prod(mesh_shape[a] for a in axes)
            assert dims[i] % split == 0, (leaf.shape, sharding.spec)
            dims[i] //= split
        total += math.prod(dims) * leaf.dtype.itemsize
    return total


@pytest.fixture(scope="module")
def tiny_step():
    c = _tiny()
    return c, aot.compile_train_step(c, TOPOLOGY, breakdown=True)


def test_state_bytes_match_an_independent_count(tiny_step):
    c, r = tiny_step
    b = r.breakdown
    mesh, _, setup = _setup(c)
    state, shardings = setup.abstract_state, setup.state_shardings
    assert b.parameter_bytes == _bytes_by_hand(state.params, shardings.params, mesh.shape) > 0
    assert b.optimizer_bytes == _bytes_by_hand(state.opt_state, shardings.opt_state, mesh.shape) > 0
    assert b.gradient_bytes == b.parameter_bytes  # the estimate: grads sharded like the params
    rows = c.data.global_batch_size // (mesh.shape["dp"] * mesh.shape["fsdp"])
    assert b.batch_bytes == len(train_steps.BATCH_KEYS) * 4 * rows * (c.data.seq_len // mesh.shape["sp"])
    # The compiler's arguments are the state (+ step and rng scalars) and the batch, padded to TPU
    # tiles ((8, 128) and the like: this tiny model's 16-wide shards pad a lot, not 2x in all).
    held = b.parameter_bytes + b.optimizer_bytes + b.batch_bytes
    assert held <= r.argument_bytes < 2 * held, (held, r.argument_bytes)
    # The remedies' per-mesh state model gives back the measured bytes on the compiled mesh.
    assert memory.bytes_on_mesh(b.state_bytes_by_axes["parameters"], r.mesh_shape) == b.parameter_bytes
    assert memory.bytes_on_mesh(b.state_bytes_by_axes["optimizer"], r.mesh_shape) == b.optimizer_bytes


def test_largest_buffers_are_sorted_real_arrays(tiny_step):
    c, r = tiny_step
    buffers = r.breakdown.largest_buffers
    assert 0 < len(buffers) <= 8
    sizes = [buf["bytes"] for buf in buffers]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0
    for buf in buffers:
        assert buf["bytes"] == math.prod(buf["shape"]) * jax.numpy.dtype(buf["dtype"]).itemsize
        assert buf["bytes"] <= r.total_bytes  # per device: no one array beyond the whole step
    assert any(buf["source"].startswith("decoder.py:") for buf in buffers)
    report = aot.format_report(c, r)
    for heading in ("per-device breakdown", "saved activations", "what one layer saves",
                    "largest arrays in the compiled step"):
        assert heading in report


def test_saved_activations_per_layer_grow_linearly_with_tokens(tiny_step):
    """Per layer, the backward keeps O(L) per device (plus parameter-sized values that do not
    depend on L): saved bytes are affine in L. Anything L x L (a score matrix) breaks it."""
    _, r = tiny_step
    per_layer = {}
    for seq_len in (1024, 2048, 4096):
        c = _tiny(seq_len)
        mesh, layout, setup = _setup(c)
        residuals = memory.layer_residuals(c, mesh, layout, setup)
        assert all(x["bytes"] == math.prod(x["shape"]) * jax.numpy.dtype(x["dtype"]).itemsize
                   for x in residuals)
        per_layer[seq_len] = sum(x["bytes"] for x in residuals if x["per_layer"])
    assert per_layer[1024] == r.breakdown.saved_bytes_per_layer > 0
    slope = per_layer[2048] - per_layer[1024]
    assert slope > 0 and per_layer[4096] - per_layer[2048] == 2 * slope, per_layer
    # What does not grow with L is at most one layer's parameters (e.g. gathered weights).
    intercept = per_layer[1024] - slope
    layer_params = sum(math.prod(p.shape[1:]) * p.dtype.itemsize
                       for p in jax.tree.leaves(setup.abstract_state.params["blocks"]))
    assert 0 <= intercept <= layer_params, (intercept, layer_params)


def test_remedies_use_the_breakdown_and_rank_by_bytes_saved(tiny_step):
    """Scale the measured breakdown up to a step over HBM: every remedy's total is the current
    total less what it saves, they come most-saved first, and the remat remedy rests on the
    measured nothing_saveable residuals."""
    c, r = tiny_step
    b = r.breakdown
    per_layer = b.saved_bytes_per_layer * (2 * r.hbm_bytes // b.saved_activation_bytes)  # 2x HBM in all
    big = dataclasses.replace(b, saved_bytes_per_layer=per_layer,
                              nothing_saveable_bytes_per_layer=per_layer // 10)
    over = dataclasses.replace(r, temp_bytes=r.temp_bytes + big.saved_activation_bytes, breakdown=big)
    assert over.fits is False
    remedies = aot.remedy_estimates(c, over)
    assert remedies, "a step over HBM gets remedies"
    saved = [x.saved_bytes for x in remedies]
    assert saved == sorted(saved, reverse=True)
    assert all(x.total_bytes == over.total_bytes - x.saved_bytes for x in remedies)
    remat = next(x for x in remedies if "nothing_saveable" in x.override)
    assert "re-measured" in remat.basis
    # Saved activations go from L layers x A to L x A/10 plus one layer recomputed (A).
    assert remat.saved_bytes == big.num_layers * (big.saved_bytes_per_layer
                                                  - big.nothing_saveable_bytes_per_layer) \
        - big.saved_bytes_per_layer
    lines = aot.suggest_remedies(c, over)
    assert [line.split(":")[0] for line in lines] == [x.override for x in remedies]


def test_a_hybrid_model_s_layer_residuals_are_those_of_a_uniform_layer():
    """A hybrid's layers keep residuals of one set of shapes whatever their type (the breakdown
    traces the first type of the period): the tiny_hybrid preset's per-layer bytes are tiny's."""
    per_layer = {}
    for preset in ("tiny", "tiny_hybrid"):
        c = base.get_config(preset)
        c.unlock()
        c.attention.layout = "zigzag"
        mesh, layout, setup = _setup(c)
        per_layer[preset] = sum(x["bytes"] for x in memory.layer_residuals(c, mesh, layout, setup)
                                if x["per_layer"])
    assert per_layer["tiny_hybrid"] == per_layer["tiny"] > 0
