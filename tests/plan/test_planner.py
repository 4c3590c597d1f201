"""The planner (longctx/plan): what it may propose, what its models count, what it chooses, and that
what it chooses compiles for TPU as a run with attention.cp=auto would start it."""

import copy
import io
import itertools
import json
import os
import re
import sys

import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.data import length_mixes
from longctx.errors import ConfigError
from longctx.model import flops
from longctx.ops import context_parallel, masks, tables
from longctx.parallel import layout as layout_lib
from longctx.plan import aot, attention_work, auto, hardware, memory_model, planner, step_time
from tests import child_env
from tests.validate_commands import ScriptServer

ROOT = child_env.ROOT
GIB = 2 ** 30
needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu is not installed (make test installs it via the [tpu] extra)")


def _config(preset="llama3_8b_128k", **sections):
    c = copy.deepcopy(base.get_config(preset))
    c.unlock()
    for section, values in sections.items():
        c[section].update(**values)
    c.lock()
    return c


def _small_tpu_config(**attention):
    """The tiny model in bf16 with the splash kernel, 8,192 tokens: compiles for v5p:2x2x2 in seconds."""
    return _config("tiny", model=dict(dtype="bfloat16"),
                   attention={"impl": "splash", "block_size": 512, **attention},
                   data=dict(seq_len=8192, global_batch_size=2), mesh=dict(dp=1, fsdp=-1, sp=4))


# ----------------------------------------------------------------------------- enumeration

def test_every_candidate_is_valid_and_every_valid_one_is_there():
    """12 query heads over 16 chips: Ulysses only where sp divides 12, usp degrees dividing both;
    zigzag needs 2 sp | seq_len; blocks divide the shards. The planner proposes exactly the
    combinations config.validate accepts (its remat and residual policies aside)."""
    c = _config(model=dict(num_heads=12, num_kv_heads=4),
                data=dict(seq_len=12_288, global_batch_size=4))
    topology = hardware.parse_topology("v5p:2x2x4")
    keys = ("mesh", "attention.cp", "attention.layout", "attention.block_size")
    rows = planner.plan(c, topology, open_keys=keys)
    proposed = set()
    for r in rows:
        config_lib.validate(r.config, num_devices=16)  # raises on anything invalid
        sp, a = r.mesh["sp"], r.config.attention
        assert (a.cp, a.cp_ulysses, a.layout, a.block_size) == (
            r.strategy.name, r.strategy.degree, r.layout, r.block)
        if r.strategy.name == "ulysses":
            assert 12 % sp == 0
        if r.strategy.name == "usp":
            assert 12 % r.strategy.degree == 0 and sp % r.strategy.degree == 0 and r.strategy.degree < sp
        proposed.add((tuple(r.mesh.values()), r.strategy.name, r.strategy.degree, r.layout, r.block))

    valid = set()
    for sp, dp in itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8, 16]):
        if 16 % (sp * dp):
            continue
        mesh = {"dp": dp, "fsdp": 16 // sp // dp, "sp": sp}
        names = [("ring", None), ("all_gather", None), ("ulysses", None)] + [
            ("usp", u) for u in range(2, sp)]
        for (name, u), layout, block in itertools.product(names, layout_lib.LAYOUTS, planner.BLOCK_SIZES):
            if sp == 1 and name != "ring" or name == "ulysses" and layout != "contiguous":
                continue
            cc = planner.candidate_config(c, mesh, planner.Strategy(name, u), layout,
                                          c.attention.residuals, c.model.remat_policy, block)
            try:
                config_lib.validate(cc, num_devices=16)
            except ConfigError:
                continue
            valid.add((tuple(mesh.values()), name, u, layout, block))
    assert proposed == valid
    assert any(p[1] == "ulysses" for p in proposed) and not any(
        p[1] == "ulysses" and p[0][2] in (8, 16) for p in proposed)


def test_the_config_keeps_what_auto_does_not_open():
    c = _config(attention=dict(cp="auto", layout="zigzag"), mesh=dict(dp=1, fsdp=-1, sp=16))
    assert planner.auto_keys(c) == ("attention.cp",)
    rows = planner.plan(c, hardware.parse_topology("v5p:4x4x4"), open_keys=planner.auto_keys(c))
    assert rows and {r.layout for r in rows} == {"zigzag"}
    assert {(r.mesh["dp"], r.mesh["sp"]) for r in rows} == {(1, 16)}  # fsdp, the -1, is 4
    assert len({str(r.strategy) for r in rows}) > 2
    assert {r.residuals for r in rows} == {c.attention.residuals}
    assert {r.block for r in rows} == {c.attention.block_size}
    assert planner.auto_keys(_config()) == ()  # cp=ring: nothing for the planner


# ----------------------------------------------------------------------------- what the models count

@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(causal=True, sliding_window=300),
                                  dict(sliding_window=(200, 60))])
@pytest.mark.parametrize("layout", layout_lib.LAYOUTS)
def test_static_blocks_are_the_exact_classifiers(mask, layout):
    spec = masks.make_mask_spec(**mask)
    for seq_len, sp, block in [(4096, 4, 128), (8192, 8, 256)]:
        exact = (tables.block_classes(spec, layout, seq_len, sp, block, block) > 0).sum(axis=(2, 3))
        np.testing.assert_array_equal(attention_work.static_step_blocks(spec, layout, seq_len, sp, block),
                                      exact)


@pytest.mark.parametrize("strategy,degree", [("ring", None), ("all_gather", None), ("ulysses", None),
                                             ("usp", 4)])
def test_the_models_flops_are_flops_py(strategy, degree):
    """Under a full mask (no block partly masked) the blocks the model prices are the pairs
    model/flops.py counts, whatever the strategy; the step's model FLOPs are flops.py's."""
    c = _config(attention=dict(causal=False, cp=strategy, cp_ulysses=degree, layout="contiguous"),
                data=dict(seq_len=32_768, global_batch_size=4), mesh=dict(dp=1, fsdp=4, sp=16))
    spec = masks.make_mask_spec(causal=False)
    schedule = attention_work.static_schedule(context_parallel.named(strategy, degree), spec, "contiguous",
                                              32_768, 16, 512)
    m = c.model
    block_model_flops = 3 * 4 * 512 * 512 * m.head_dim * m.num_heads * m.num_layers
    assert schedule.computed_blocks * c.data.global_batch_size * block_model_flops == \
        flops.attention_flops_per_step(c)
    mesh = {"dp": 1, "fsdp": 4, "sp": 16}
    e = step_time.estimate(c, hardware.parse_topology("v5p:4x4x4"), schedule, mesh)
    assert e.model_flops == flops.flops_per_step(c) == \
        flops.dense_flops_per_step(c) + flops.attention_flops_per_step(c)


def test_mfu_counts_the_flops_the_documents_need():
    """Rows of 256-token documents at 65,536 tokens: MFU's numerator counts attention inside each
    document (256 x 257 / 2 causal pairs each), never more than the blocks a device computes, so
    no row's MFU passes the fraction of peak its fastest part reaches (crediting the whole row's
    causal pairs read 80-94% here, with 1.6x the FLOPs a device computes, and 902% for
    docs/planner.md's 2,097,152-token command)."""
    c = _config(data=dict(seq_len=65_536, global_batch_size=1))
    ids = length_mixes.segment_ids_of([256], 65_536)
    assert step_time.document_pairs(c, ids) == 256 * 256 * 257 / 2
    assert step_time.document_pairs(c, None) == 65_536 * 65_537 / 2
    rows = planner.plan(c, hardware.parse_topology("v5p:2x2x2"),
                        open_keys=("mesh", "attention.cp", "attention.layout"), segment_ids=ids)
    assert len(rows) > 5
    dense, attention = flops.dense_flops_per_step(c), flops.attention_flops_per_step(c)
    for r in rows:
        s = r.step
        assert s.model_flops == pytest.approx(dense + attention * (256 * 256 * 257) / (65_536 * 65_537))
        assert s.model_flops / s.num_chips <= s.device_flops  # counted work is work done
        assert 0 < s.mfu <= max(step_time.CONSTANTS["matmul"], step_time.CONSTANTS["attention"])
    # padding attends to nothing; a row of one document is flops.py's count
    padded = np.where(np.arange(65_536) < 32_768, 1, 0)[None]
    assert step_time.document_pairs(c, padded) == 32_768 * 32_769 / 2
    assert step_time.model_flops_per_step(c, None) == flops.flops_per_step(c)


def test_axes_take_the_torus_innermost_first():
    v5p = hardware.parse_topology("v5p:4x4x4")
    spans = hardware.axis_links(v5p, {"dp": 1, "fsdp": 4, "sp": 16}, ("sp", "fsdp", "dp"))
    assert spans == {"sp": 2.0, "fsdp": 1.0, "dp": 0.0}
    assert hardware.axis_links(v5p, {"dp": 1, "fsdp": 1, "sp": 64}, ("sp", "fsdp", "dp"))["sp"] == 3.0
    assert hardware.axis_links(v5p, {"dp": 2, "fsdp": 4, "sp": 8}, ("sp", "fsdp", "dp")) == \
        {"sp": 1.5, "fsdp": 1.5, "dp": 1.0}
    # an axis of one chip has no links: sp = 4 of v5p:2x2x1 spans its two axes of 2, not three
    v5p_flat = hardware.parse_topology("v5p:2x2x1")
    assert hardware.axis_links(v5p_flat, {"dp": 1, "fsdp": 1, "sp": 4}, ("sp", "fsdp", "dp"))["sp"] == 2.0
    assert hardware.axis_links(v5p_flat, {"dp": 1, "fsdp": 2, "sp": 2}, ("sp", "fsdp", "dp")) == \
        {"sp": 1.0, "fsdp": 1.0, "dp": 0.0}
    gpus = hardware.parse_topology("h100:16")
    assert hardware.axis_links(gpus, {"dp": 2, "fsdp": 1, "sp": 8}, ("sp", "fsdp", "dp"))["sp"] == 1.0
    with pytest.raises(ValueError, match="v5p:4x4x4"):
        hardware.parse_topology("v9z:4x4")


# ----------------------------------------------------------------------------- what it chooses

def _best(rows, name):
    return next(r for r in rows if r.strategy.name == name)


def test_all_gather_wins_a_short_gqa_sequence_on_many_chips():
    """8 KV heads, 32,768 tokens over 16-chip rings on 512 chips: K/V are small next to Q, so one
    gather beats 16 ring passes and Ulysses' all-to-alls of Q, and is within 1% of the fastest
    (usp x4, whose ring is 4 passes of a group's K/V)."""
    c = _config(data=dict(seq_len=32_768, global_batch_size=32), mesh=dict(dp=1, fsdp=-1, sp=16))
    rows = planner.plan(c, hardware.parse_topology("v5p:8x8x8"),
                        open_keys=("attention.cp", "attention.layout"))
    # by predicted time (the first rows are a tie, planner.break_ties: ranked apart)
    fastest = min((r for r in rows if r.fits), key=lambda r: r.step.seconds)
    gathered = min((r for r in rows if r.strategy.name == "all_gather"), key=lambda r: r.step.seconds)
    ring = min((r for r in rows if r.strategy.name == "ring"), key=lambda r: r.step.seconds)
    assert gathered.step.seconds <= fastest.step.seconds * 1.01, [(str(r.strategy), r.step.seconds) for r in rows[:5]]
    assert ring.step.seconds > 1.05 * gathered.step.seconds


def test_all_gather_cannot_fit_where_the_ring_does():
    """8B at 4,194,304 tokens on 64 v5p chips: every chip would hold the whole sequence's K/V and
    their float32 gradients for a layer (tens of GiB) beside its own shard's activations. (At
    2,097,152 tokens it still fits, barely: the compile needs 92.4 of 95 GiB,
    docs/fit_strategies.md.)"""
    c = _config(data=dict(seq_len=4_194_304, global_batch_size=1))
    rows = planner.plan(c, hardware.parse_topology("v5p:4x4x4"),
                        open_keys=("mesh", "attention.cp", "attention.layout", "attention.residuals"))
    gathered = [r for r in rows if r.strategy.name == "all_gather"]
    assert gathered and not any(r.fits for r in gathered)
    assert rows[0].fits and rows[0].strategy.name != "all_gather"
    assert any(r.fits for r in rows if r.strategy.name == "ring")


def test_memory_model_is_calibrated_on_the_compiles():
    """Within 25% of the TPU compiler's own figure for the 8B preset at 131,072 tokens, ring
    (docs/fit_strategies.json: 15.9 GiB; the calibration's largest held-out error is 22%)."""
    c = _config(data=dict(seq_len=131_072, global_batch_size=4), mesh=dict(dp=1, fsdp=4, sp=16))
    estimate = memory_model.per_device_bytes(c, {"dp": 1, "fsdp": 4, "sp": 16})
    assert abs(estimate.total_bytes / (15.9 * GIB) - 1) < 0.25


def test_calibration_constants_are_what_the_fit_gives(tmp_path):
    """benchmarks/calibrate_planner.py fits the constants longctx holds, and reports the error on
    the held-out points."""
    out = tmp_path / "calibration.json"
    result = ScriptServer.run([sys.executable, os.path.join(ROOT, "benchmarks", "calibrate_planner.py"),
                               "--json", str(out), "--md", str(tmp_path / "calibration.md")],
                              cwd=ROOT, env=child_env.script_env(), # a guard against a hang, not a speed test: the fit takes about ten
                              # CPU seconds (each point counted once, step_time.terms)
                              timeout=1200)
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["step_time"]["constants"] == step_time.CONSTANTS
    assert doc["memory"]["activation_scale"] == memory_model.ACTIVATION_SCALE
    summary = doc["step_time"]["summary"]
    assert summary["held_out_points"] > summary["fit_points"] > 0
    # what the tie rule calls a tie (planner.break_ties) is the error the calibration reports
    assert round(summary["held_out_mean_abs_error"], 2) == step_time.HELD_OUT_ERROR
    assert "held-out" in (tmp_path / "calibration.md").read_text()


# ----------------------------------------------------------------------------- auto, and it compiles

def test_auto_is_the_planners_best_row_the_same_every_time():
    devices = [type("Device", (), {"device_kind": "TPU v5", "platform": "tpu", "coords": (x, y, z)})()
               for x in range(4) for y in range(4) for z in range(4)]
    c = _config(attention=dict(cp="auto"), mesh=dict(dp=1, fsdp=-1, sp=-1))
    assert auto.topology_of(devices).name == "v5p:4x4x4"
    first, again = auto.resolve(c, devices), auto.resolve(c, devices)
    rows = planner.plan(c, hardware.parse_topology("v5p:4x4x4"), open_keys=planner.auto_keys(c))
    best = next(r for r in rows if r.fits)
    assert first.chosen.overrides() == again.chosen.overrides() == best.overrides()
    config_lib.validate(first.config, num_devices=64)
    assert first.run_info()["plan"]["chosen"]["cp"] == best.strategy.name
    # what run_info.json records for any run on a chip the planner knows: its own config, priced
    own = auto.prediction(first.config, devices)
    assert own["overrides"] == best.overrides() and own["predicted"]["step_seconds"] > 0


def test_block_size_auto_is_the_planners_block_and_nothing_else_changes():
    devices = [type("Device", (), {"device_kind": "TPU v5", "platform": "tpu", "coords": (x, y, z)})()
               for x in range(4) for y in range(4) for z in range(4)]
    c = _config(attention=dict(block_size="auto", layout="zigzag"))  # cp=ring, mesh fixed
    assert planner.auto_keys(c) == ("attention.block_size",)
    resolution = auto.resolve(c, devices)
    rows = planner.plan(c, hardware.parse_topology("v5p:4x4x4"), open_keys=planner.auto_keys(c))
    best = next(r for r in rows if r.fits)
    assert {r.block for r in rows} == set(planner.BLOCK_SIZES)  # every block was priced
    a = resolution.config.attention
    assert a.block_size == best.block and (a.cp, a.layout) == ("ring", "zigzag")
    assert (c.mesh.dp, c.mesh.fsdp, c.mesh.sp) == (1, -1, 16)
    assert resolution.chosen.mesh == {"dp": 1, "fsdp": 4, "sp": 16}  # the preset's, -1 resolved
    line = auto.describe(resolution)
    assert line.startswith("attention.block_size=auto: the planner chose ring") and f"block {best.block}" in line
    # asked together with cp=auto: the planner opens the three keys
    both = _config(attention=dict(block_size="auto", cp="auto"), mesh=dict(dp=1, fsdp=-1, sp=-1))
    assert planner.auto_keys(both) == ("attention.cp", "attention.layout", "attention.block_size")


def test_block_size_auto_fits_shards_shorter_than_every_planned_block():
    """The tiny preset's 256-token shards (1,024 tokens over sp=4) take none of BLOCK_SIZES: the
    plan tries the largest block the ring accepts there, and auto starts with it, instead of
    finding no candidate."""
    c = _config("tiny", attention=dict(block_size="auto"))
    devices = [type("Device", (), {"device_kind": "TPU v5 lite", "platform": "tpu", "coords": (x, y, 0)})()
               for x in range(2) for y in range(4)]
    resolution = auto.resolve(c, devices)
    chosen = resolution.chosen
    assert chosen.block == {"zigzag": 128}.get(chosen.layout, 256)  # zigzag: within each half
    config_lib.validate(resolution.config, num_devices=8)
    assert planner.block_choices(c, 4, "contiguous") == (256,)
    assert planner.block_choices(_config(), 16, "zigzag") == planner.BLOCK_SIZES
    assert planner.fallback_block(c, 8) == 128 and planner.fallback_block(_config(), 64) == 512


def test_a_chip_whose_kernels_were_timed_tries_the_blocks_its_model_was_fitted_at():
    """On v5e the step model's kernel constants are the chip's own, fitted at blocks of 512, 1,024
    and 2,048, and the chip ran the preset's causal row fastest at 2,048 (1.567 s a step against
    1.670 at 1,024: docs/tpu.md): the plan tries all three and picks 2,048, whatever block the
    config names; other chips keep BLOCK_SIZES."""
    assert planner.block_sizes("v5e") == (512, 1024, 2048)
    assert planner.block_sizes("v5p") == planner.block_sizes(None) == planner.BLOCK_SIZES
    c = _config("v5e_0p5b", attention=dict(use_segment_ids=False, block_size=512))
    best = planner.plan(c, hardware.parse_topology("v5e:1x1"))[0]
    assert best.fits and best.block == 2048


def test_auto_on_a_chip_the_planner_does_not_know_is_one_sentence():
    cpu = [type("Device", (), {"device_kind": "cpu", "platform": "cpu"})()] * 8
    with pytest.raises(ConfigError, match=r"attention.cp=auto .* cpu devices .* set --config.attention.cp=ring"):
        auto.resolve(_config("tiny", attention=dict(cp="auto")), cpu)
    assert auto.prediction(_config("tiny"), cpu) is None
    with pytest.raises(ConfigError, match="attention.cp=auto is chosen by the planner"):
        config_lib.validate(_config("tiny", attention=dict(cp="auto")), num_devices=8)
    with pytest.raises(ConfigError, match="attention.block_size=auto is chosen by the planner"):
        config_lib.validate(_config("tiny", attention=dict(block_size="auto")), num_devices=8)
    for wrong in ("big", 128.0, True):  # the key takes "auto", so it is typed object: validate checks
        with pytest.raises(ConfigError, match=f"attention.block_size={wrong!r} must be a positive integer"):
            config_lib.validate(_config("tiny", attention=dict(block_size=wrong)), num_devices=8)


@pytest.mark.tpu_aot
@needs_libtpu
def test_the_top_row_and_autos_choice_compile_for_tpu():
    """The full plan's best row, and what attention.cp=auto starts, compile for v5p:2x2x2 and fit;
    auto's compile is of the planner's row (aot.compile_train_step resolves auto as a run does)."""
    topology = hardware.parse_topology("v5p:2x2x2")
    rows = planner.plan(_small_tpu_config(), topology)
    top = aot.compile_train_step(rows[0].config, "v5p:2x2x2")
    assert top.fits and top.mesh_shape == rows[0].mesh

    c = _small_tpu_config(cp="auto", block_size="auto")
    devices = aot.topology_devices("v5p:2x2x2")
    resolution = auto.resolve(c, devices)
    assert resolution.config.attention.block_size == resolution.chosen.block
    started = aot.compile_train_step(c, "v5p:2x2x2")
    assert started.fits and started.mesh_shape == resolution.chosen.mesh
    assert top.cost_flops and top.cost_flops > 0  # XLA's own count, reported beside the model's


@needs_libtpu
def test_offload_qkv_is_refused_for_tpu_in_one_sentence_and_never_planned():
    """libtpu's compiler aborts the process on a step with offload_qkv: refused before compiling."""
    c = _small_tpu_config(residuals="offload_qkv")
    with pytest.raises(ConfigError, match="offload_qkv does not compile for TPU"):
        aot.compile_train_step(c, "v5p:2x2x2")
    rows = planner.plan(_small_tpu_config(), hardware.parse_topology("v5p:2x2x2"))
    assert rows and "offload_qkv" not in {r.residuals for r in rows}


# ----------------------------------------------------------------------------- the command

def test_a_long_plan_says_how_far_it_is():
    """plan() reports every valid (mesh, strategy, layout, block) it has priced and, with
    documents, the ring tables on them it has built (the slow part); progress_lines writes a line
    each PROGRESS_EVERY_S seconds (on a fake clock here) and nothing for a plan that ends sooner."""
    c = _config(data=dict(seq_len=32_768, global_batch_size=4))
    v5p = hardware.parse_topology("v5p:2x2x2")
    for ids in (None, length_mixes.segment_ids_of([1000, 7000], 32_768)):
        calls = []
        rows = planner.plan(c, v5p, open_keys=("mesh", "attention.cp", "attention.layout"), segment_ids=ids,
                            progress=lambda *args: calls.append(args))
        total = len({(tuple(r.mesh.values()), r.strategy, r.layout, r.block) for r in rows})
        assert [call[:2] for call in calls] == [(i, total) for i in range(1, total + 1)] and total > 10
        # per layout (the static ones and, with documents, per_document) and sp (block 512)
        layouts = len(layout_lib.LAYOUTS + layout_lib.ROW_LAYOUTS)
        tables = 0 if ids is None else layouts * len({r.mesh["sp"] for r in rows})
        assert calls[-1][2:] == (tables, tables)
        assert [call[2] for call in calls] == sorted(call[2] for call in calls)

    out, now = io.StringIO(), [100.0]
    report = planner.progress_lines(out, every=10.0, clock=lambda: now[0])
    for done, t in [(1, 100.0), (2, 109.9), (3, 110.0), (4, 115.0), (5, 125.0)]:
        now[0] = t
        report(done, 5, done // 2, 2)
    assert out.getvalue().splitlines() == [
        "plan: 3 of 5 (mesh, strategy, layout, block) priced, the documents' block tables 1 of 2, 10 s",
        "plan: 5 of 5 (mesh, strategy, layout, block) priced, the documents' block tables 2 of 2, 25 s"]
    report(6, 6, 0, 0)  # without documents
    now[0] = 140.0
    report(6, 6, 0, 0)
    assert out.getvalue().splitlines()[-1] == "plan: 6 of 6 (mesh, strategy, layout, block) priced, 40 s"


def _plan(*args):
    return ScriptServer.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args], cwd=ROOT,
                            env=child_env.script_env(), timeout=300)


def test_plan_prints_a_ranked_table_and_json():
    args = ["--config=configs/base.py:llama3_8b_128k", "--topology=v5p:2x2x2", "--seq-len", "32768",
            "--compile", "0", "--top", "5"]
    table = _plan(*args)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "| 1 |" in table.stdout and "run #1: --config.mesh.dp=" in table.stdout
    assert "MFU counts the model FLOPs of rows of one document" in table.stdout
    result = _plan(*args, "--json", "--doc-lengths", "1000,7000")
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    steps = [r["predicted"]["step_seconds"] for r in doc["rows"]]
    untied = [s for s, r in zip(steps, doc["rows"]) if not r["tie"]]  # a tie is ranked apart (planner.break_ties)
    assert len(steps) == 5 and untied == sorted(untied) and doc["documents"] == "--doc-lengths 1000,7000"
    assert [r["tie"] for r in doc["rows"]] == sorted((r["tie"] for r in doc["rows"]), reverse=True)
    assert all(r["why"] for r in doc["rows"])
    assert all(0 < r["predicted"]["mfu"] <= 1 for r in doc["rows"])


def test_train_with_auto_on_cpu_is_one_line_before_anything_runs(tmp_path):
    result = ScriptServer.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                               "--config=configs/base.py:tiny", f"--workdir={tmp_path / 'run'}",
                               "--config.attention.block_size=auto"], cwd=ROOT, env=child_env.script_env(),
                              timeout=300)
    assert result.returncode == 2  # the flag parses (the key takes an int or auto); the chip is unknown
    lines = [line for line in result.stderr.splitlines() if line.startswith("longctx: ")]
    assert len(lines) == 1 and "attention.block_size=auto needs the step-time model's figures" in lines[0], result.stderr
    # the block it says to set is one the tiny preset's 256-token shards take (512 was refused)
    block = re.fullmatch(r".*set --config\.attention\.block_size=(\d+)\.", lines[0]).group(1)
    config_lib.validate(_config("tiny", attention=dict(block_size=int(block))), num_devices=8)
    assert not (tmp_path / "run").exists()


def test_plan_bad_topology_is_one_line():
    result = _plan("--config=configs/base.py:tiny", "--topology=v5p:4xx4", "--compile", "0")
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("longctx: ")] == [
        "longctx: topology 'v5p:4xx4': '4xx4' is not sizes joined by x (e.g. 4x4x4)."]
