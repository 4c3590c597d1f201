"""Smoke tests of the scale scripts: estimate.py (AOT fit check) and the bench_*.py quick modes.

Each script runs as a subprocess, as a user would run it, writing into a temporary directory.
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from configs import base
from longctx import cli
from longctx import config as config_lib
from longctx.model import flops
from longctx.plan import aot
from tests import ROOT as REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_common  # noqa: E402
from tests.validate_commands import ScriptServer

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu is not installed (the [tpu] extra)")

# An upper bound on any CPU core's float32 rate: 2 FMA units x 16 lanes (AVX-512) x 2 FLOP x 4 GHz.
# A benchmark whose FLOPs over its time beat cores x this did not time the work it reports.
CPU_CORE_PEAK_FLOPS = 2 * 16 * 2 * 4e9
BATCH_KEYS = 5  # int32 [rows, L] arrays per batch: tokens, segment_ids, positions, targets, loss_mask
# The train step's other argument: the learning-rate schedule's four float32 numbers
# (optimizer.schedule_values), which a TPU lays out in one tile of 128.
SCHEDULE_BYTES = {"cpu": 4 * 4, "tpu": 128 * 4}


def _state_bytes(config) -> int:
    """float32 parameters and AdamW's two moments."""
    return 12 * config_lib.num_params_estimate(config)


def _assert_memory_adds_up(r):
    assert r["total_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"], r


def run(*args, env=None, timeout=300):
    full_env = dict(os.environ)  # the scripts pick their own device counts
    full_env.update(env or {})
    return ScriptServer.run([sys.executable, *args], cwd=REPO, env=full_env, timeout=timeout)


@needs_libtpu
def test_libtpu_start_up_settings_do_not_outlive_the_topology(monkeypatch):
    """What aot sets while libtpu starts is taken back: a TPU_WORKER_HOSTNAMES left behind would
    make every process started from this one take itself for a host of a TPU pod."""
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.setenv("TPU_HOST_BOUNDS", "2,2,1")  # the user's own setting stays
    assert len(aot.topology_devices("v5p:2x2x2")) == 8
    assert "TPU_WORKER_HOSTNAMES" not in os.environ and os.environ["TPU_HOST_BOUNDS"] == "2,2,1"


@needs_libtpu
@pytest.mark.tpu_aot
def test_estimate_tiny_on_v5p_fits_and_prints_memory():
    """Also what it says while it works: each compile is named on stderr before it starts (a user
    waits minutes for a big one)."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    proc = subprocess.Popen([sys.executable, "scripts/estimate.py", "--config=configs/base.py:tiny",
                             "--topology=v5p:2x2x2", "--json"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert first == "estimate: compiling the train step for v5p:2x2x2 (takes seconds) ...\n"
        assert proc.poll() is None  # said while the compile runs, not after
        second = proc.stderr.readline()
        assert re.fullmatch(r"estimate: compiled in \d+ s; compiling one layer of it for the breakdown \.\.\.\n",
                            second)
        stdout, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, first + second + rest)
    assert p.returncode == 0, p.stderr[-2000:]
    # libtpu, loaded for the topology, printed half a dozen start-up lines here (aot._topology)
    for line in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "INVALID_ARGUMENT",
                 "Source Location Trace"):
        assert line not in p.stderr, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["fits"] is True and out["num_devices"] == 8 and out["device_kind"].startswith("TPU v5")
    assert out["hbm_bytes"] == 95 * aot.GIB  # a v5p chip
    # Per device, from the shapes: the donated train state lies between sharded over all 8 devices
    # and replicated; the others are this device's batch shard (rows x L int32 arrays) and the
    # schedule.
    c = base.get_config("tiny")
    mesh = out["mesh_shape"]
    assert mesh == {"dp": 1, "fsdp": 2, "sp": 4}
    state = _state_bytes(c)
    assert state / 8 <= out["alias_bytes"] <= state + 1024, (out["alias_bytes"], state)
    rows, shard = c.data.global_batch_size // (mesh["dp"] * mesh["fsdp"]), c.data.seq_len // mesh["sp"]
    assert (out["argument_bytes"] - out["alias_bytes"]
            == BATCH_KEYS * 4 * rows * shard + SCHEDULE_BYTES["tpu"])
    _assert_memory_adds_up(out)
    assert 0 < out["temp_bytes"] and out["total_bytes"] < out["hbm_bytes"] and out["remedies"] == []
    # The breakdown (tests/plan/test_memory_breakdown.py checks its figures): unpadded state and batch
    # within the compiler's (tile-padded) arguments; saved activations per layer x layers.
    b = out["breakdown"]
    assert b["parameter_bytes"] + b["optimizer_bytes"] + b["batch_bytes"] <= out["argument_bytes"]
    assert b["saved_activation_bytes"] == c.model.num_layers * b["saved_bytes_per_layer"] > 0
    assert b["residuals"] and b["largest_buffers"] and out["remedy_estimates"] == []


@needs_libtpu
@pytest.mark.tpu_aot
def test_estimate_on_one_v5e_chip():
    """v5e:1x1, the single-chip VM: libtpu's default v5e host is 2x2 chips, so it refused the name
    ("not divisible by the given (or default) chips_per_host_bounds"); now one chip is its own
    host. The report has the compiler's total and the planner's memory model beside it."""
    p = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--topology=v5e:1x1", "--config.mesh.fsdp=1",
            "--config.mesh.sp=1", "--config.attention.impl=splash", "--nobreakdown", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["topology"] == "v5e:1x1" and out["num_devices"] == 1 and out["device_kind"] == "TPU v5 lite"
    assert out["fits"] is True and out["mesh_shape"] == {"dp": 1, "fsdp": 1, "sp": 1}
    _assert_memory_adds_up(out)
    assert out["memory_model_bytes"] > _state_bytes(base.get_config("tiny"))


@needs_libtpu
def test_estimate_bad_topology_is_one_sentence():
    p = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--topology=v5p:banana")
    assert p.returncode == 2
    last = [line for line in p.stderr.splitlines() if line.startswith("longctx:")]
    assert len(last) == 1 and "v5p:banana" in last[0] and "not known to libtpu" in last[0]
    assert "Traceback" not in p.stderr


@needs_libtpu
def test_sweep_points_compile_once_each(tmp_path):
    out = str(tmp_path / "fit")
    p = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--sweep", "--nosweep_grow",
            "--nosweep_shrink", "--sweep_points=v5p:2x2x2/4/256", f"--sweep_out={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.load(open(out + ".json"))
    assert [(q["topology"], q["sp"], q["shard_len"]) for q in r["points"]] == [("v5p:2x2x2", 4, 256)]
    assert r["best"][0]["longest_seq_len"] == 1024 and r["best"][0]["compiles"] == 1
    assert len(r["source"]) == 16  # a later sweep reuses these points only with the same code
    assert "one compile at its first L" in open(out + ".md").read()
    bad = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--sweep",
              "--sweep_points=v5p:2x2x2/four/256", f"--sweep_out={out}")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "'v5p:2x2x2/four/256' is not topology/sp/L" in bad.stderr


def test_remedies_for_a_step_that_does_not_fit():
    from configs import base

    c = base.get_config("llama3_8b_128k")
    gib = aot.GIB
    r = aot.CompiledStep(topology="v5p:4x4x4", device_kind="TPU v5", num_devices=64,
                         mesh_shape={"dp": 1, "fsdp": 4, "sp": 16}, argument_bytes=22 * gib,
                         output_bytes=22 * gib, alias_bytes=22 * gib, temp_bytes=150 * gib,
                         compile_seconds=1.0)
    assert r.fits is False
    remedies = aot.suggest_remedies(c, r)
    assert remedies and any("--config.mesh.sp=32" in x for x in remedies)
    assert all("GiB per chip" in x for x in remedies)
    report = aot.format_report(c, r)
    assert "fits         NO" in report and "suggested remedies" in report
    # v4 topologies give one device per TensorCore: each gets half the chip's HBM.
    v4 = aot.CompiledStep(topology="v4:2x2x1", device_kind="TPU v4", num_devices=8,
                          mesh_shape={"dp": 1, "fsdp": 8, "sp": 1}, argument_bytes=1, output_bytes=1,
                          alias_bytes=1, temp_bytes=1, compile_seconds=1.0, cores_per_chip=2)
    assert v4.hbm_bytes == 16 * gib


def test_compiler_out_of_memory_messages_are_parsed():
    g = aot.GIB
    temps = aot._oom_bytes("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                           "for HLO temporaries (203.11G) exceeds available HBM (95.74G).")
    assert temps == (int(203.11 * g), int(95.74 * g))
    total = aot._oom_bytes("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent "
                           "error. Ran out of memory in memory space hbm. Used 15.88G of 15.75G hbm.",
                           argument_bytes=5 * g)
    assert total == (int(15.88 * g) - 5 * g, int(15.75 * g))
    assert aot._oom_bytes("something else") is None


def test_benchmarks_md_sections_are_replaced_not_duplicated(tmp_path):
    md = str(tmp_path / "b.md")
    bench_common.write_section("a", "## A\none", md)
    bench_common.write_section("b", "## B\ntwo", md)
    bench_common.write_section("a", "## A\nthree", md)
    text = open(md).read()
    assert text.count("BEGIN a") == 1 and "three" in text and "one" not in text and "two" in text
    assert text.index("BEGIN a") < text.index("BEGIN b")


def test_a_page_stopped_mid_write_keeps_what_it_held(tmp_path, monkeypatch):
    page = str(tmp_path / "p.json")
    bench_common.write_json(page, {"rows": [1]})

    def stopped(*_):
        raise KeyboardInterrupt  # as a timeout's signal would land, between write and rename

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        bench_common.write_json(page, {"rows": [1, 2]})
    assert json.load(open(page)) == {"rows": [1]}


def test_largest_square_finds_score_matrices():
    hlo = "x = f32[1,4,2048,2048]{3,2,1,0} y = bf16[2048,512] z = f32[4,2048,64]"
    assert bench_common.largest_square(hlo, 2048) == ["f32[1,4,2048,2048]"]
    assert bench_common.largest_square(hlo, 4096) == []


def test_bench_attention_quick(tmp_path):
    p = run("benchmarks/bench_attention.py", "--quick", "--json", str(tmp_path / "a.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "a.json"))
    (row,) = out["timings"]  # --quick: xla, causal, S=1024, sp=4
    S, sp, block = row["seq_len"], row["sp"], row["block"]
    assert (row["impl"], row["mask"], S, sp, row["layout"]) == ("xla", "causal", 1024, 4, "zigzag")
    # The schedule, from S, sp and the block: causal keeps the n(n+1)/2 blocks on and below the
    # diagonal of n = S/block; unpruned computes all n^2. Zigzag gives every device the same work
    # at every step (efficiency 1); contiguous leaves step 0 (m(m+1)/2 blocks of m = n/sp) short
    # and, at step s, the s devices whose K/V come from later positions idle.
    n, m = S // block, S // block // sp
    assert row["ring"]["computed_blocks"] == row["contig"]["computed_blocks"] == n * (n + 1) // 2
    assert row["unpruned"]["computed_blocks"] == n * n
    assert row["ring"]["efficiency"] == 1.0 and row["unpruned"]["efficiency"] == 1.0
    contig = n * (n + 1) / 2 / (sp * (m * (m + 1) / 2 + (sp - 1) * m * m))
    assert row["contig"]["efficiency"] == pytest.approx(contig, abs=5e-4)
    assert all(row[v]["ring_steps"] == sp for v in ("ring", "contig", "unpruned"))
    # The times: one per round; no faster than the FLOPs allow (fwd QK^T, PV + bwd 5 matmuls = 14
    # FLOP per (query, key, head_dim) element; batch 1, 4 heads of 64); ratios as reported.
    cores = out["machine"]["cpu_count"]
    blocks = {"ring": n * (n + 1) // 2, "contig": n * (n + 1) // 2, "unpruned": n * n, "dense": n * n}
    for name, computed in blocks.items():
        t = row[name]
        assert len(t["times_s"]) == out["repeats"] and t["min_s"] == min(t["times_s"]) <= t["median_s"]
        work = 14 * computed * block * block * 64 * 4
        assert t["min_s"] >= work / (cores * CPU_CORE_PEAK_FLOPS), (name, t["min_s"], work)
    assert row["speedup_vs_unpruned"] == pytest.approx(row["unpruned"]["min_s"] / row["ring"]["min_s"])
    assert row["speedup_vs_dense"] == pytest.approx(row["dense"]["min_s"] / row["ring"]["min_s"])
    assert sorted(c["sp"] for c in out["compile"]) == [2, 4]
    assert all(0 < c["lower_s"] <= c["compile_s"] for c in out["compile"])
    assert "BEGIN bench_attention" in open(tmp_path / "b.md").read()


def test_bench_memory_quick_cpu(tmp_path):
    p = run("benchmarks/bench_memory.py", "--quick", "--no-tpu", "--cpu-layers", "unrolled",
            "--json", str(tmp_path / "m.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "m.json"))
    assert [r["sp"] for r in out["weak"]] == [r["sp"] for r in out["strong"]] == [2, 4]
    # bench_memory.model_config(quick=True): the model every row compiles, split over sp (fsdp=1).
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(vocab_size=512, d_model=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                   mlp_dim=768)
    state = _state_bytes(c)
    for r in out["weak"] + out["strong"]:
        assert r["arrays_with_two_dims_ge_L"] == [], r  # no L x L score matrix anywhere
        assert r["L"] == r["seq_len"] // r["sp"] and r["mesh"] == {"dp": 16 // r["sp"], "fsdp": 1, "sp": r["sp"]}
        # The donated state, split over sp (+ a few scalars), and one row of L tokens per device
        # and the schedule besides.
        assert state // r["sp"] <= r["alias_bytes"] <= state // r["sp"] + 1024, (r["alias_bytes"], state)
        assert r["argument_bytes"] - r["alias_bytes"] == BATCH_KEYS * 4 * r["L"] + SCHEDULE_BYTES["cpu"]
        _assert_memory_adds_up(r)
    # What the script exists to show. Weak scaling (L fixed): per-device memory flat, within the
    # script's own 10% target. Strong scaling (S fixed): halving L (sp 2 -> 4) cuts the activation
    # (temporary) memory by at most half (less means something grows faster than L) and by at
    # least a fifth (most of it scales with L).
    weak = [r["total_bytes"] for r in out["weak"]]
    assert max(weak) <= 1.10 * min(weak), weak
    temp2, temp4 = (r["temp_bytes"] for r in out["strong"])
    assert 0.5 <= temp4 / temp2 < 0.8, (temp2, temp4)
    assert "BEGIN bench_memory" in open(tmp_path / "b.md").read()


def test_bench_train_quick(tmp_path):
    p = run("benchmarks/bench_train.py", "--quick", "--json", str(tmp_path / "t.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "t.json"))
    (row,) = out["rows"]  # --quick: mesh 1x2x4, 1 timed step of 2 x 256 tokens
    assert row["mesh"] == {"dp": 1, "fsdp": 2, "sp": 4} and row["layout"] == "zigzag"
    tokens = out["batch"] * out["seq_len"]
    assert len(row["step_times_s"]) == out["steps"] and row["median_step_s"] == np.median(row["step_times_s"])
    assert row["tokens_per_s"] == pytest.approx(tokens / row["median_step_s"], rel=1e-9)
    assert row["compile_and_first_step_s"] > row["median_step_s"]  # the first step also compiles
    # The step did the model's work: its FLOPs in its time fit on this machine's cores, and the loss
    # on uniformly random tokens, two steps from a random init, is about ln(vocab) (never below).
    c = base.get_config("tiny")
    c.unlock()
    c.data.update(seq_len=out["seq_len"], global_batch_size=out["batch"])
    assert flops.flops_per_step(c) / row["median_step_s"] <= out["machine"]["cpu_count"] * CPU_CORE_PEAK_FLOPS
    assert math.log(c.model.vocab_size) - 0.1 < row["loss"] < math.log(c.model.vocab_size) + 1.5, row["loss"]


def test_bench_data_quick(tmp_path):
    p = run("benchmarks/bench_data.py", "--seq-lens", "8192", "--packers", "best_fit", "concat_then_split",
            "--workers", "0", "--tokens", "1e5", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    results = {r["packer"]: r for r in json.load(open(tmp_path / "bench_data.json"))["results"]}
    for r in results.values():
        # at least 4 batches of 4 rows x 8192 positions; the rate is those positions over the time
        assert r["tokens"] == 4 * r["batch_size"] * r["seq_len"] == 4 * 4 * 8192
        assert r["tokens"] / r["tokens_per_s"] == pytest.approx(r["seconds"], abs=6e-4)
    # The figure the script exists for: the share of positions that carry a real token.
    assert 0.9 < results["best_fit"]["non_padding"] <= 1.0
    assert results["concat_then_split"]["non_padding"] == 1.0  # cuts documents, never pads


def test_bench_checkpoint_small(tmp_path):
    p = run("benchmarks/bench_checkpoint.py", "--d-model", "128", "--num-layers", "1", "--mlp-dim", "256",
            "--saves", "3", "--out", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "bench_checkpoint.json"))
    # The state is float32 parameters and two AdamW moments; on disk, that (compressed or not) plus
    # metadata. What it measures: every save blocks the loop no longer than the whole save takes,
    # and the restore gives back the saved state bit for bit.
    assert out["state_mb"] == pytest.approx(12 * out["num_params"] / 1e6, abs=0.06)
    assert 0.25 * out["state_mb"] <= out["checkpoint_on_disk_mb"] <= 1.1 * out["state_mb"] + 0.5
    assert len(out["saves"]) == 3
    for s in out["saves"]:
        assert 0 < s["blocked_s"] <= s["total_s"] and s["fraction"] == pytest.approx(s["blocked_s"] / s["total_s"],
                                                                                   abs=1e-3)
    assert out["restore_bitwise_equal"] is True and out["saved_then_donated_mid_save_bitwise_equal"] is True
