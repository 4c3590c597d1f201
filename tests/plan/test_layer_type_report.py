"""The schedule report per layer type (longctx/plan/layer_type_report.py, ring_report.py --config):
each type of a hybrid model on its own mask, block and strategy, its bytes by the closed form and,
for abstract TPU devices, as the lowered program sends them."""
import json
import os
import sys

import jax
import numpy as np
import pytest

from configs import base
from longctx.plan import aot, layer_type_report
from tests.validate_commands import ScriptServer

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "scripts", "ring_report.py")


def _ring_report(*args):
    return ScriptServer.run([sys.executable, SCRIPT, *args], timeout=300)


def _tiny_hybrid(sp=4):
    config = base.get_config("tiny_hybrid")
    config.mesh.update(dp=1, fsdp=1, sp=sp)
    return config


def test_each_type_is_reported_on_its_own_mask_and_strategy():
    config = _tiny_hybrid()
    seq_len = config.data.seq_len
    ids = np.ones((1, seq_len), np.int32)
    local, global_ = layer_type_report.type_reports(config, sp=4, layout="contiguous", segment_ids=ids)
    assert (local.name, local.layers, local.strategy) == ("local", 5, "halo")
    assert (global_.name, global_.layers, global_.strategy) == ("global", 1, "ring")
    assert local.mask == "causal, window 128" and global_.mask == "causal"
    # a window of 128 inside shards of seq_len / 4 reaches only the shard before: one exchange of
    # one block (the ring's one step sends the whole shard), and the causal ring runs every step
    assert local.halo_offsets == (1,) and local.ring_steps == (0, 1)
    assert global_.ring_steps == (0, 1, 2, 3)
    shard_blocks = seq_len // 4 // local.block
    assert shard_blocks > 1
    assert local.sent["forward"] * shard_blocks == local.formula["ring"]["forward"]
    assert local.computed_blocks < global_.computed_blocks
    assert local.sent == local.formula["halo"] and global_.sent == global_.formula["ring"]


def test_a_uniform_model_is_one_type_named_default():
    config = base.get_config("tiny")
    config.mesh.update(dp=1, fsdp=1, sp=4)
    (only,) = layer_type_report.type_reports(config, sp=4, layout="zigzag",
                                             segment_ids=np.ones((1, config.data.seq_len), np.int32))
    assert only.layers == config.model.num_layers and only.strategy == config.attention.cp


def test_the_markdown_marks_each_type_s_own_strategy_and_the_step_total():
    config = _tiny_hybrid()
    found = layer_type_report.type_reports(config, sp=4, layout="contiguous",
                                           segment_ids=np.ones((1, config.data.seq_len), np.int32))
    text = layer_type_report.markdown(found)
    halo = sum(found[0].formula["halo"].values()) / 2 ** 20
    assert f"**{halo:,.1f}**" in text
    step = sum(r.layers * sum(r.sent.values()) for r in found) / 2 ** 20
    assert f"A step sends {step:,.1f} MiB" in text


def test_ring_report_config_prints_one_json_object_per_type():
    run = _ring_report("--config", "configs/base.py:tiny_hybrid", "--sp", "4", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert [t["name"] for t in out["types"]] == ["local", "global"]
    assert [t["strategy"] for t in out["types"]] == ["halo", "ring"]


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")
def test_the_lowered_tpu_program_sends_what_the_formula_says_for_each_type():
    config = _tiny_hybrid()
    devices = aot.topology_devices("v5p:2x2x1")
    mesh = jax.sharding.Mesh(np.array(devices[:4]), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    found = layer_type_report.type_reports(config, sp=4, layout="contiguous", mesh=mesh,
                                           segment_ids=np.ones((1, config.data.seq_len), np.int32))
    for r in found:
        assert r.lowered == r.sent, r.name
    assert 0 < sum(found[0].lowered.values()) < sum(found[1].lowered.values())


def test_a_type_left_to_cp_auto_is_named_with_the_fix():
    from longctx.errors import ConfigError

    config = _tiny_hybrid()
    config.unlock()
    config.attention.layer_types["global"].cp = "auto"
    with pytest.raises(ConfigError, match=r"attention.layer_types.global.cp='auto'.*scripts/plan.py"):
        layer_type_report.type_reports(config, sp=4, layout="contiguous",
                                       segment_ids=np.ones((1, config.data.seq_len), np.int32))


def test_an_sp_that_does_not_divide_the_sequence_names_the_sequence():
    """(validate names d_model first, split over sp with the parameters, which this report does
    not split.)"""
    run = _ring_report("--config", "configs/base.py:tiny_hybrid", "--sp", "3")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "longctx: --sp 3 does not divide the 1,024-token sequence, which the sp devices hold in equal shards: "
        "pass an --sp that does (2, 4, 8, 16, ...) or another --seq-len."], run.stderr
