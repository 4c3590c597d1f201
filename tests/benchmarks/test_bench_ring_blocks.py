"""Smoke test of benchmarks/bench_ring_blocks.py on a small ring, run as a user would run it.

Asserts what load on a shared machine cannot change: one row per (case, block), every variant
timed and matching the dense oracle, a smaller block computing no more (query, key) pairs with
skipping on, and a report line per block.
"""
import json
import os
import sys

from tests import ROOT as REPO
from tests.validate_commands import ScriptServer


def test_bench_ring_blocks_small(tmp_path):
    out_json, out_md = tmp_path / "blocks.json", tmp_path / "benchmarks.md"
    p = ScriptServer.run(
        [sys.executable, "benchmarks/bench_ring_blocks.py", "--blocks", "256,128", "--cases",
         "docs_s32", "--seq-len", "2048", "--impls", "xla", "--layouts", "contiguous",
         "--repeats", "1", "--json", str(out_json), "--md", str(out_md)],
        cwd=REPO, env=dict(os.environ), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["case"], r["block"], r["checked"]) for r in rows] == [("docs_s32", 256, True),
                                                                     ("docs_s32", 128, True)]
    pairs = {}
    for row in rows:
        assert set(row["variants"]) == {"xla/contiguous", "xla/contiguous/noskip"}
        for name, v in row["variants"].items():
            assert v["status"] == "ok" and v["check"]["passed"], (row["block"], name, v)
            assert len(v["times_s"]) == 1 and v["median_s"] > 0
        on, off = row["variants"]["xla/contiguous"], row["variants"]["xla/contiguous/noskip"]
        assert 0 < on["computed_blocks"] < off["computed_blocks"]
        pairs[row["block"]] = on["computed_blocks"] * row["block"] ** 2
    assert pairs[128] < pairs[256], pairs
    md = out_md.read_text()
    assert "<!-- BEGIN bench_ring_blocks -->" in md
    assert "- block 256: docs_s32 S=2048" in md and "- block 128: docs_s32 S=2048" in md
