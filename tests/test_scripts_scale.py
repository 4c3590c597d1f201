"""Smoke tests of the scale scripts: estimate.py (AOT fit check) and the bench_*.py quick modes.

Each script runs as a subprocess, as a user would run it, writing into a temporary directory.
"""

import json
import os
import subprocess
import sys

import pytest

from longctx import aot

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import bench_common  # noqa: E402

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu is not installed (the [tpu] extra)")


def run(*args, env=None, timeout=300):
    full_env = dict(os.environ)
    full_env.pop("XLA_FLAGS", None)  # the scripts pick their own device counts
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@needs_libtpu
@pytest.mark.tpu_aot
def test_estimate_tiny_on_v5p_fits_and_prints_memory():
    p = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--topology=v5p:2x2x2", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["fits"] is True and out["num_devices"] == 8 and out["device_kind"].startswith("TPU v5")
    assert out["argument_bytes"] > 0 and out["temp_bytes"] > 0
    assert out["total_bytes"] < out["hbm_bytes"] and out["remedies"] == []


@needs_libtpu
def test_estimate_bad_topology_is_one_sentence():
    p = run("scripts/estimate.py", "--config=configs/base.py:tiny", "--topology=v5p:banana")
    assert p.returncode == 2
    last = [line for line in p.stderr.splitlines() if line.startswith("estimate:")]
    assert len(last) == 1 and "v5p:banana" in last[0] and "not known to libtpu" in last[0]
    assert "Traceback" not in p.stderr


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


def test_largest_square_finds_score_matrices():
    hlo = "x = f32[1,4,2048,2048]{3,2,1,0} y = bf16[2048,512] z = f32[4,2048,64]"
    assert bench_common.largest_square(hlo, 2048) == ["f32[1,4,2048,2048]"]
    assert bench_common.largest_square(hlo, 4096) == []


def test_bench_attention_quick(tmp_path):
    p = run("scripts/bench_attention.py", "--quick", "--json", str(tmp_path / "a.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "a.json"))
    row = out["timings"][0]
    for name in ("ring", "contig", "unpruned", "dense"):
        assert row[name]["median_s"] > 0
    assert {c["sp"] for c in out["compile"]} == {2, 4}
    assert "BEGIN bench_attention" in open(tmp_path / "b.md").read()


def test_bench_memory_quick_cpu(tmp_path):
    p = run("scripts/bench_memory.py", "--quick", "--no-tpu", "--cpu-layers", "unrolled",
            "--json", str(tmp_path / "m.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "m.json"))
    assert [r["sp"] for r in out["weak"]] == [2, 4]
    for r in out["weak"] + out["strong"]:
        assert r["total_bytes"] > 0 and r["arrays_with_two_dims_ge_L"] == []
    assert "BEGIN bench_memory" in open(tmp_path / "b.md").read()


def test_bench_train_quick(tmp_path):
    p = run("scripts/bench_train.py", "--quick", "--json", str(tmp_path / "t.json"),
            "--md", str(tmp_path / "b.md"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.load(open(tmp_path / "t.json"))
    assert out["rows"] and all(r["tokens_per_s"] > 0 for r in out["rows"])
