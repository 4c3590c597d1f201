"""docs/tpu_kernels.md as benchmarks/bench_tpu_kernels.py writes it (rows of different head
shapes are different kernels, each compared only with its own shape; a run no row names any more
leaves the page), the masks its flags accept, and each row on the page as soon as it is measured.
Nothing here needs a chip."""
import importlib.util
import json
import os

import pytest

from tests import ROOT


def _bench():
    path = os.path.join(ROOT, "benchmarks", "bench_tpu_kernels.py")
    spec = importlib.util.spec_from_file_location("bench_tpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(impl, head_dim, block, ms, vmem="default"):
    return dict(run="r", impl=impl, vmem="own" if impl == "longctx" else vmem, mask="causal",
                S=32768, heads=8, kv_heads=8, head_dim=head_dim, block=block, fwd_ms=ms / 3,
                fwdbwd_ms=ms, fwdbwd_tflops=1.0, pct_peak=1.0)


def test_each_head_shape_is_its_own_section_and_comparison():
    rows = [_row("longctx", 64, 1024, 60.0), _row("stock", 64, 1024, 50.0),
            _row("longctx", 256, 1024, 100.0), _row("stock", 256, 1024, 200.0)]
    page = _bench().markdown(dict(rows=rows, commands=[], device="TPU v5 lite"))
    narrow, wide = page.split("head_dim 64")[1].split("head_dim 256")
    assert "| 32,768 | causal | 1024 | 50.0 | default | — | — | 60.0 | 1.20 | — | r |" in narrow
    assert ("| 32,768 | causal | 1024 | 200.0 | default | — | — | 100.0 | 0.50 | — | r |"
            in wide.split("## longctx by block")[0])
    assert "| 32,768 | causal | 8/8 x 64 | 20.0 / 60.0 |" in page
    assert "| 32,768 | causal | 8/8 x 256 | 33.3 / 100.0 |" in page


def test_side_by_side_takes_each_peer_at_the_faster_limit_of_the_same_run():
    rows = [_row("longctx", 128, 2048, 60.0), _row("stock", 128, 2048, 50.0, vmem="raised"),
            _row("stock", 128, 2048, 70.0, vmem="default"),
            dict(_row("stock", 128, 2048, 10.0, vmem="raised"), run="another run"),
            _row("tokamax", 128, 2048, 80.0, vmem="raised"), _row("tokamax", 128, 2048, 75.0),
            dict(_row("tokamax", 128, 2048, 5.0), run="another run")]
    page = _bench().markdown(dict(rows=rows, commands=[], device="TPU v5 lite"))
    side_by_side = page.split("Each at its best")[0]
    assert "| 32,768 | causal | 2048 | 50.0 | raised | 75.0 | default | 60.0 | 1.20 | 0.80 | r |" in side_by_side


def test_a_longctx_row_with_tokamax_alone_beside_it_is_side_by_side():
    rows = [_row("longctx", 128, 1024, 60.0), _row("tokamax", 128, 1024, 120.0),
            dict(_row("stock", 128, 1024, 50.0), run="another run")]
    page = _bench().markdown(dict(rows=rows, commands=[], device="TPU v5 lite"))
    side_by_side = page.split("Each at its best")[0]
    assert "| 32,768 | causal | 1024 | — | — | 120.0 | default | 60.0 | — | 0.50 | r |" in side_by_side


def test_a_run_measured_again_in_full_leaves_the_list_of_commands(tmp_path):
    bench, path = _bench(), str(tmp_path / "kernels.json")
    old = [_row("longctx", 128, 1024, 60.0), dict(_row("longctx", 128, 2048, 50.0), run="kept")]
    bench.bc.write_json(path, dict(rows=old, commands=["[r] first", "[kept] second"], device="d"))
    data = bench._merge(path, [dict(_row("longctx", 128, 1024, 55.0), run="new")], "d", "[new] third")
    assert data["commands"] == ["[kept] second", "[new] third"]
    assert sorted(r["run"] for r in data["rows"]) == ["kept", "new"]


def test_one_document_is_a_causal_rows_pairs_through_the_document_path():
    bench = _bench()
    ids = bench._document_ids("one_document", 64)
    assert ids is not None and len(set(ids.tolist())) == 1
    assert bench._pairs("one_document", 64, ids) == bench._pairs("causal", 64, None) == 64 * 65 // 2
    assert bench._document_ids("causal", 64) is None
    assert len(set(bench._document_ids("documents", 4096).tolist())) == bench.DOCUMENTS
    page = bench.markdown(dict(rows=[dict(_row("longctx", 128, 1024, 60.0), mask="one_document")],
                               commands=[], device="TPU v5 lite"))
    assert "| 32,768 | one document | 8/8 x 128 | 20.0 / 60.0 |" in page


def test_an_unknown_mask_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exited:
        _bench()._arguments(["--masks", "causal,docs"])
    assert exited.value.code == 2
    assert "docs is not a mask this benchmark runs; choose from causal, window, documents" in capsys.readouterr().err


def test_each_row_is_written_as_it_arrives_so_a_run_cut_short_keeps_it(tmp_path):
    bench = _bench()
    page = str(tmp_path / "kernels.json")
    args = bench._arguments(["--json", page, "--md", str(tmp_path / "kernels.md"),
                             "--block-table", str(tmp_path / "blocks.json"), "--run", "r"])
    first, second = _row("longctx", 128, 1024, 60.0), _row("stock", 128, 1024, 62.0)

    def a_child_stopped_after_two_rows():
        yield bench.DEVICE + "TPU v5 lite\n"
        yield "device TPU v5 lite, scoped VMEM default\n"
        yield bench.ROW + json.dumps(first) + "\n"
        # the first row is on the page before the child measures the next
        assert [r["impl"] for r in json.load(open(page))["rows"]] == ["longctx"]
        yield bench.ROW + json.dumps(second) + "\n"

    rows = []
    bench.record(args, a_child_stopped_after_two_rows(), rows)
    data = json.load(open(page))
    assert data["device"] == "TPU v5 lite"
    assert [r["impl"] for r in data["rows"]] == ["longctx", "stock"]
    assert json.load(open(tmp_path / "blocks.json"))["TPU v5 lite"][0]["block"] == 1024
    assert sorted(os.listdir(tmp_path)) == ["blocks.json", "kernels.json", "kernels.md"]
