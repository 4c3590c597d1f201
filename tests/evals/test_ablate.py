"""A small mask-ablation grid runs end to end, reports, and skips finished variants on a re-run."""

import json
import os
import subprocess
import sys

import pytest

from longctx.config import ConfigError
from longctx.evals import ablation

GRID = "configs/ablations/smoke.py"


def run_ablate(*args):
    return subprocess.run([sys.executable, "scripts/ablate.py", *args], capture_output=True, text=True,
                          timeout=900)


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
