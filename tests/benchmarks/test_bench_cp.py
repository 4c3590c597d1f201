"""benchmarks/bench_cp.py --render-only on the committed docs/bench_cp.json (a copy): the report
says that CPU timings do not show interconnect costs, puts the bytes beside every strategy's
time, has the target line per strategy and impl, and the 8B communication table. Cheap
(a subprocess that imports jax; nothing compiles). The run itself is the benchmark's job: its
oracle checks and the formula-vs-HLO agreement are in the JSON this reads."""
import json
import os
import shutil
import sys

from tests import ROOT as REPO
from tests.validate_commands import ScriptServer


def test_bench_cp_render_only(tmp_path):
    src = os.path.join(REPO, "docs", "bench_cp.json")
    shutil.copy(src, tmp_path / "bench_cp.json")
    p = ScriptServer.run([sys.executable, "benchmarks/bench_cp.py", "--render-only", "--json",
                          str(tmp_path / "bench_cp.json"), "--md", str(tmp_path / "b.md")],
                         cwd=REPO, env=dict(os.environ), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.load(open(src))
    md = (tmp_path / "b.md").read_text()
    assert "<!-- BEGIN bench_cp -->" in md and "CPU timings do not show interconnect costs" in md
    strategies = result["settings"]["strategies"]
    for row in result["rows"]:
        for name, v in row["variants"].items():
            if "strategy" in v:  # every longctx variant ran and matched the oracle
                assert v["status"] == "ok", (row["case"], name, v.get("status"))
        for strategy in strategies:  # the program sends what the formula says
            c = row["communication"][strategy]
            if c["unknown_loops"] == 0:
                assert [c["hlo"][p]["sent_bytes"] for p in ("forward", "backward")] == \
                    [c["formula_bytes"][p] for p in ("forward", "backward")], (row["case"], strategy)
            assert f"{strategy}/" in md
    if any(r["case"] == "docs_s32" for r in result["rows"]):
        for strategy in strategies:
            for impl in result["settings"]["impls"]:
                assert any(line.startswith("docs_s32") and f": {strategy} {impl} " in line
                           for line in result["targets"]), (strategy, impl)
    assert "Llama-3-8B attention at 131,072 tokens, sp = 16" in md
    for r in result["llama3_8b"]["rows"]:
        if "tpu_lowering" in r:
            assert [r["tpu_lowering"][p]["sent_bytes"] for p in ("forward", "backward")] == \
                [r["formula_bytes"][p] for p in ("forward", "backward")], r["strategy"]
