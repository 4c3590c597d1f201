"""A small mask-ablation grid runs end to end, reports, and skips finished variants on a re-run."""

import json
import os
import subprocess
import sys

import pytest

from longctx.config import ConfigError
from longctx.evals import ablation
from tests.validate_commands import ScriptServer

GRID = "configs/ablations/smoke.py"


def run_ablate(*args):
    return ScriptServer.run([sys.executable, "scripts/ablate.py", *args], timeout=900)


def test_grid_runs_reports_and_skips_finished(tmp_path):
    first = run_ablate(f"--grid={GRID}", f"--workdir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    table = (tmp_path / "ablation.md").read_text()
    for variant in ("causal", "sliding_window_64", "no_document_mask"):
        assert f"| {variant} | 4 |" in table
        info = json.loads((tmp_path / variant / "run_info.json").read_text())
        assert 0 < info["ring_schedule_efficiency"] <= 1
    assert (tmp_path / "ablation.png").stat().st_size > 0
    assert (tmp_path / "position_loss.png").stat().st_size > 0
    # the eval step reported loss by position for every run
    val = [json.loads(line) for line in open(tmp_path / "causal" / "metrics.jsonl") if "val/loss" in line]
    assert val and len(val[-1]["val/loss_by_position"]) == len(val[-1]["val/position_bucket_starts"])
    # with the tokens behind each bucket (the loss past a window averages buckets by them)
    tokens = val[-1]["val/tokens_by_position"]
    assert len(tokens) == len(val[-1]["val/position_bucket_starts"]) and sum(tokens) > 0

    second = run_ablate(f"--grid={GRID}", f"--workdir={tmp_path}")
    assert second.returncode == 0
    assert second.stdout.count("finished, skipping") == 3


def test_dry_run_prints_one_command_per_variant(tmp_path):
    result = run_ablate("--grid=configs/ablations/masks.py", f"--workdir={tmp_path}", "--dry-run")
    assert result.returncode == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 7
    assert any("--config.attention.sliding_window=128" in line for line in lines)
    assert not os.listdir(tmp_path)  # nothing ran


def test_unknown_key_in_a_grid_is_one_sentence(tmp_path):
    grid = tmp_path / "bad.py"
    grid.write_text('BASE = "configs/base.py:tiny"\n'
                    'def get_grid():\n    return {"typo": {"attention.slidin_window": 3}}\n')
    with pytest.raises(ConfigError, match="grid variant 'typo': unknown config key 'attention.slidin_window'"):
        ablation.load_grid(str(grid))
    result = run_ablate(f"--grid={grid}", f"--workdir={tmp_path / 'runs'}")
    assert result.returncode == 2  # bad input (longctx.cli)
    assert "unknown config key" in result.stderr


def test_every_variant_is_checked_before_the_first_trains(tmp_path):
    """A bad value in the last variant is one line and exit status 2 before any run starts, not
    after the variants before it have trained."""
    grid = tmp_path / "grid.py"
    grid.write_text('BASE = "configs/base.py:tiny"\n'
                    'def get_grid():\n    return {"first": {}, "typo": {"attention.layout": "zigzagg"}}\n')
    result = run_ablate(f"--grid={grid}", f"--workdir={tmp_path / 'runs'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == "" and not (tmp_path / "runs").exists()
    assert result.stderr.splitlines() == [
        "longctx: grid variant 'typo': attention.layout='zigzagg' is not one of 'contiguous', 'zigzag', "
        "'striped', 'per_document', 'auto'."], result.stderr


def test_each_variant_says_which_of_how_many_it_is(tmp_path, monkeypatch):
    """A grid's runs take minutes each: the line before each says "variant k of N" (with the
    runs themselves replaced here by a stand-in that succeeds; the first variant finished)."""
    started = []
    monkeypatch.setattr(ablation.subprocess, "run",
                        lambda command, cwd: started.append(command) or subprocess.CompletedProcess(command, 0))
    _, variants = ablation.load_grid(GRID)
    (tmp_path / "causal").mkdir()
    (tmp_path / "causal" / "metrics.jsonl").write_text(
        json.dumps({"step": variants[0].config.train.num_steps, "train/loss": 1.0}) + "\n")
    (tmp_path / "no_document_mask").mkdir()  # an unfinished run
    lines = []
    ablation.run_grid(GRID, str(tmp_path), echo=lines.append)
    assert lines == ["ablate: variant 1 of 3 (causal): finished, skipping",
                     "ablate: variant 2 of 3 (sliding_window_64): starting",
                     "ablate: variant 3 of 3 (no_document_mask): resuming"]
    assert [c[3] for c in started] == [f"--workdir={tmp_path / v}" for v in ("sliding_window_64", "no_document_mask")]


def test_the_masks_grid_docstring_states_the_presets_shard():
    """configs/ablations/masks.py explains its windows against the shard of its BASE preset (it
    said 2,048 tokens and 512-token shards; the tiny preset is 1,024 and 256)."""
    from configs.ablations import masks

    base, variants = ablation.load_grid("configs/ablations/masks.py")
    config = variants[0].config
    seq_len, sp = config.data.seq_len, config.mesh.sp
    text = " ".join(masks.__doc__.split())
    assert base == masks.BASE == "configs/base.py:tiny"
    assert f"sequences of {seq_len:,} tokens over sp={sp}" in text, text
    assert f"a shard of {seq_len // sp} tokens" in text, text
    windows = {v.name: v.overrides.get("attention.sliding_window") or v.overrides.get("attention.chunk_size")
               for v in variants}
    assert f"window of {windows['sliding_window_128']} reaches half a shard" in text and (
        windows["sliding_window_128"] * 2 == seq_len // sp)
    assert windows["sliding_window_512"] == windows["chunked_causal_512"] == 2 * (seq_len // sp)
