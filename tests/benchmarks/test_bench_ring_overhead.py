"""Smoke test of benchmarks/bench_ring_overhead.py on a small ring, run as a user would run it.

Timings on a shared machine can take any value, so it asserts what they cannot change: the run
finishes, the four variants compute the blocks they should (the documents fewer than one
document per row, which computes as many as skipping off; rows of padding none), and the
report's figures are the decomposition time = F + c x blocks of its own medians.
"""
import json
import os
import sys

import pytest

from tests import ROOT as REPO
from tests.validate_commands import ScriptServer


def test_bench_ring_overhead_small(tmp_path):
    out_json, out_md = tmp_path / "overhead.json", tmp_path / "benchmarks.md"
    p = ScriptServer.run(
        [sys.executable, "benchmarks/bench_ring_overhead.py", "--impls", "xla", "--sps", "2",
         "--seq-len", "2048", "--repeats", "1", "--json", str(out_json), "--md", str(out_md)],
        cwd=REPO, env=dict(os.environ), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (row,) = json.loads(out_json.read_text())["rows"]
    assert (row["impl"], row["sp"], row["seq_len"]) == ("xla", 2, 2048)
    assert 0 < row["docs_blocks"] < row["one_doc_blocks"] == row["noskip_blocks"]
    assert row["padding_blocks"] == 0 and row["padding_s"] > 0
    c = row["block_s"]
    assert c == pytest.approx((row["one_doc_s"] - row["docs_s"])
                              / (row["one_doc_blocks"] - row["docs_blocks"]))
    assert row["docs_s"] == pytest.approx(row["fixed_s"] + c * row["docs_blocks"])
    assert row["noskip_s"] == pytest.approx(row["fixed_noskip_s"] + c * row["noskip_blocks"])
    # The F allowed for 4x is the F at which the speedup would be exactly 4x.
    allowed = row["fixed_for_target_s"]
    assert ((row["fixed_noskip_s"] + c * row["noskip_blocks"])
            / (allowed + c * row["docs_blocks"])) == pytest.approx(4.0)
    md = out_md.read_text()
    assert "bench_ring_overhead.py" in md and "F of one step (all padding)" in md
