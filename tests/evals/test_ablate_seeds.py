"""Ablations with seeds and the hybrid-attention grid: scripts/ablate.py --seeds N runs each
variant N times and reports mean and spread; the table says which variants the runs do not tell
apart and the loss past each variant's window. The runs are stubbed (as in test_ablate.py)."""

import json
import math
import subprocess
import sys

import pytest

from longctx.evals import ablation
from longctx.evals import ablation_stats as stats
from longctx.model import layer_types
from tests.validate_commands import ScriptServer

HYBRID = "configs/ablations/hybrid.py"
SMOKE = "configs/ablations/smoke.py"


def write_run(run_dir, *, steps, train_loss, val_loss, tokens_per_s=1000.0, position=None):
    """A finished run's metrics.jsonl (two train lines, one eval) and run_info.json."""
    run_dir.mkdir(parents=True)
    val = {"step": steps, "val/loss": val_loss}
    if position:
        starts, losses, tokens = position
        val.update({"val/position_bucket_starts": starts, "val/loss_by_position": losses,
                    "val/tokens_by_position": tokens})
    lines = [{"step": steps // 2, "train/loss": train_loss + 1.0, "train/tokens_per_s": tokens_per_s},
             {"step": steps, "train/loss": train_loss, "train/tokens_per_s": tokens_per_s}, val]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "run_info.json").write_text(json.dumps({"layout": "zigzag", "mesh": {"dp": 1, "fsdp": 2, "sp": 4},
                                                       "ring_schedule_efficiency": 0.5, "ring_steps_run": 2}))


def test_the_hybrid_grid_validates_and_repeats_each_pattern_whole():
    result = ScriptServer.run([sys.executable, "scripts/ablate.py", f"--grid={HYBRID}", "--workdir=runs/x",
                               "--seeds=3", "--validate_only"], timeout=300)
    assert result.returncode == 0, result.stderr
    assert "the 5 variants of configs/ablations/hybrid.py are fine" in result.stdout + result.stderr
    _, variants = ablation.load_grid(HYBRID)
    shard = variants[0].config.data.seq_len // variants[0].config.mesh.sp
    blind = {}
    for v in variants:
        period = layer_types.pattern(v.config.attention)
        assert v.config.model.num_layers % len(period) == 0, v.name  # no remainder: ratios are exact
        blind[v.name] = ablation.blind_from(v.config)
    seq_len, sp = variants[0].config.data.seq_len, variants[0].config.mesh.sp
    from configs.ablations import hybrid

    text = " ".join(hybrid.__doc__.split())
    assert f"sequences of {seq_len:,} tokens over sp={sp}" in text and f"a shard of {shard} tokens" in text
    assert f"{variants[0].config.model.num_layers} layers" in text
    assert blind == {"global_only": None, "gpt_oss_1to1_window32_sinks": 33, "cohere_3to1_window128_nope": 129,
                     "gemma3_5to1_window128": 129, "llama4_3to1_chunk256_nope": shard}


def test_a_layer_types_dict_reaches_the_training_run_through_its_command(tmp_path):
    """A variant's attention.layer_types dict travels as its Python literal on train.py's command
    line: validate sees the type's key (a bad chunk inside the dict is named), a good one passes."""
    _, variants = ablation.load_grid(HYBRID)
    llama4 = next(v for v in variants if v.name.startswith("llama4"))
    good = llama4.command("configs/base.py:tiny", str(tmp_path), seed=1) + ["--validate_only"]
    assert any(arg.startswith("--config.attention.layer_types={") for arg in good)
    assert "--config.seed=1" in good and f"--workdir={tmp_path / llama4.name / 'seed_1'}" in good
    ok = subprocess.run(good, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    llama4.overrides["attention.layer_types"] = {"local": {"chunk_size": 0}, "global": {"rope": False}}
    bad = subprocess.run(llama4.command("configs/base.py:tiny", str(tmp_path)) + ["--validate_only"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "attention.layer_types.local.chunk_size=0" in bad.stderr, bad.stderr


def test_seeds_run_in_their_own_workdirs_and_resume(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(ablation.subprocess, "run",
                        lambda command, cwd: started.append(command) or subprocess.CompletedProcess(command, 0))
    _, variants = ablation.load_grid(SMOKE)
    write_run(tmp_path / "causal" / "seed_0", steps=variants[0].config.train.num_steps, train_loss=1.0, val_loss=1.0)
    (tmp_path / "causal" / "seed_1").mkdir()  # an unfinished run
    lines = []
    ablation.run_grid(SMOKE, str(tmp_path), seeds=2, echo=lines.append)
    assert lines[:3] == ["ablate: variant 1 of 3 (causal), seed 0 (1 of 2): finished, skipping",
                         "ablate: variant 1 of 3 (causal), seed 1 (2 of 2): resuming",
                         "ablate: variant 2 of 3 (sliding_window_64), seed 0 (1 of 2): starting"]
    assert len(lines) == 6 and len(started) == 5
    assert [(c[3], c[-1]) for c in started[:2]] == [
        (f"--workdir={tmp_path / 'causal' / 'seed_1'}", "--config.seed=1"),
        (f"--workdir={tmp_path / 'sliding_window_64' / 'seed_0'}", "--config.seed=0")]
    # one seed keeps today's layout and command (no seed flag)
    assert variants[0].command("b", "w")[3] == "--workdir=w/causal" and "--config.seed" not in " ".join(
        variants[0].command("b", "w"))


def test_seeds_aggregate_to_mean_and_sample_std_and_the_table_says_what_is_within_the_spread(tmp_path):
    _, variants = ablation.load_grid(SMOKE)
    steps = variants[0].config.train.num_steps
    # causal and sliding_window_64 differ by 0.05 with std 0.1 (not told apart); no_document_mask is
    # 1.0 away from both
    val = {"causal": (2.0, 2.2, 2.1), "sliding_window_64": (2.05, 2.15, 2.25), "no_document_mask": (3.1, 3.2, 3.15)}
    starts, tokens = [0, 1, 3, 7, 15, 31, 63, 127, 255, 511], [2, 4, 8, 16, 32, 64, 128, 256, 300, 100]
    for name, losses in val.items():
        for seed, loss in enumerate(losses):
            by_position = [loss + i / 10 for i in range(len(starts))]
            write_run(tmp_path / name / f"seed_{seed}", steps=steps, train_loss=loss + 0.5, val_loss=loss,
                      tokens_per_s=1000.0 * (seed + 1), position=(starts, by_position, tokens))
    for seed, found in enumerate(([[0.0, 1.0, 1.0]], [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])):  # (lengths x depths)
        (tmp_path / "causal" / f"seed_{seed}" / "needle.json").write_text(
            json.dumps({"depths": [0.0, 0.5, 1.0], "accuracy": found}))
    rows = {r["variant"]: r for r in ablation.summarize(variants, str(tmp_path), seeds=3)}
    causal = rows["causal"]
    assert causal["seeds"] == 3 and causal["steps"] == steps
    assert causal["val_loss"] == pytest.approx(2.1) and causal["val_loss_std"] == pytest.approx(0.1)
    assert causal["train_loss"] == pytest.approx(2.6) and causal["train_loss_std"] == pytest.approx(0.1)
    assert causal["tokens_per_s"] == pytest.approx(2000.0)
    assert rows["sliding_window_64"]["val_loss"] == pytest.approx(2.15)
    assert causal["within_spread"] == ["sliding_window_64"]
    assert rows["sliding_window_64"]["within_spread"] == ["causal"]
    assert rows["no_document_mask"]["within_spread"] == []
    # the window of 64 blinds a layer from position 65: the buckets from 127 on, weighted by tokens
    window = rows["sliding_window_64"]
    assert window["blind_from"] == 65 and window["past_from"] == 127
    by_hand = [sum((loss + i / 10) * n for i, n in zip(range(7, 10), tokens[7:])) / sum(tokens[7:])
               for loss in val["sliding_window_64"]]
    assert window["past_loss"] == pytest.approx(sum(by_hand) / 3)
    assert window["reference_past_loss"] == pytest.approx(
        sum(sum((loss + i / 10) * n for i, n in zip(range(7, 10), tokens[7:])) / sum(tokens[7:])
            for loss in val["causal"]) / 3)
    assert causal["past_from"] is None and causal["past_loss"] is None

    table = ablation.markdown_table(list(rows.values()))
    assert "| causal | 4 | 3 | 2.6000 ± 0.1000 | 2.1000 ± 0.1000 | sliding_window_64 | – |" in table
    assert "| no_document_mask | 4 | 3 | 3.6500 ± 0.0500 | 3.1500 ± 0.0500 | – |" in table
    assert "| sliding_window_64 | 4 | 3 |" in table and "| 127 |" in table
    # passkey by depth: the mean over lengths, then over the seeds that evaluated it
    assert "| passkey at depth 0% / 50% / 100% |" in table
    assert "| 0.50 / 0.75 / 1.00 |" in table and table.count("| – | 2000 |") == 2
    assert "mean over 3 seeds ± their sample standard deviation (n - 1)" in table
    assert "less than the larger of the two standard deviations" in table
    paths = ablation.write_report(list(rows.values()), str(tmp_path), "ablate.py --seeds=3")
    assert table in open(paths["table"]).read()
    assert all(open(paths[k], "rb").read(4) == b"\x89PNG" for k in ("curves", "position"))


def test_a_hybrid_variant_has_no_single_ring_schedule(tmp_path):
    """run_info.json's ring schedule is attention.*'s: for a hybrid variant the table says "–"."""
    _, variants = ablation.load_grid(HYBRID)
    for v in variants[:2]:
        write_run(tmp_path / v.name, steps=v.config.train.num_steps, train_loss=1.0, val_loss=1.0)
    rows = ablation.summarize(variants[:2], str(tmp_path))
    assert (rows[0]["schedule_efficiency"], rows[0]["ring_steps"]) == (0.5, 2)  # global only
    assert (rows[1]["schedule_efficiency"], rows[1]["ring_steps"]) == (None, None)


def test_stats_by_hand():
    assert stats.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert stats.mean_std([1.0, None]) == (1.0, None) and stats.mean_std([None]) == (None, None)
    assert stats.blind_from([None, 128], [None]) == 129 and stats.blind_from([None], [256, None]) == 256
    assert stats.blind_from([32], [16]) == 16 and stats.blind_from([None], [None]) is None
    starts = [0, 1, 3, 7, 15]
    assert stats.first_bucket_from(4, starts) == 7 and stats.first_bucket_from(3, starts) == 3
    assert stats.first_bucket_from(16, starts) is None
    assert stats.loss_from(3, starts, [9.0, 9.0, 1.0, 2.0, None], [1, 2, 3, 1, 0]) == pytest.approx(5 / 4)
    # a difference equal to the spread is told apart; a smaller one is not
    assert stats.within_spread(["a", "b"], [1.0, 1.5], [0.5, 0.1]) == {"a": [], "b": []}
    assert stats.within_spread(["a", "b"], [1.0, 1.4], [0.5, 0.1]) == {"a": ["b"], "b": ["a"]}
    assert stats.within_spread(["a", "b"], [1.0, 1.01], [None, None]) == {"a": [], "b": []}
    assert stats.mean_curve([[(1, 2.0), (2, 1.0)], [(1, 4.0)]]) == [(1, 3.0, 2.0, 4.0)]
    assert math.isclose(stats.mean_lists([[1.0, None], [3.0, 2.0]])[0], 2.0)


def test_kv_bytes_per_step_sum_each_layer_types_closed_form():
    """scripts/ablate.py prices a variant's K/V traffic per step from collectives.formula per
    layer type: a uniform ring model is num_layers x one layer's bytes; a hybrid is the sum of its
    types' over their layers."""
    sys.path.insert(0, "scripts")
    import ablate  # noqa: E402 (the script, for its pricing function)

    from longctx.plan import collectives

    _, variants = ablation.load_grid(HYBRID)
    mesh = {"dp": 1, "fsdp": 2, "sp": 4}
    uniform, one_to_one = variants[0], variants[1]
    c = uniform.config
    shape = collectives.Shape(1, c.data.seq_len, 4, c.model.num_heads, c.model.num_kv_heads, c.model.head_dim, 4,
                              documents=True)
    full = sum(collectives.formula("ring", shape).values())
    assert ablate.kv_bytes_per_step(c, "contiguous", mesh) == 12 * full
    # the local layers pass their halo (cp="halo"): a window of 32 one block of 128 from one
    # neighbour; the Llama-4-like chunk of one shard (256) starts at each document's start, so it
    # reaches 255 keys back: the shard before, whole (with no documents it would send nothing)
    exchanges = collectives.halo_exchanges(shape, sliding_window=32, layout="contiguous", block=128)
    assert [(e.offset, e.stop - e.start) for e in exchanges] == [(1, 128)]
    window = sum(collectives.formula("halo", shape, sliding_window=32, layout="contiguous",
                                     block=128).values())
    assert 0 < window < full
    assert ablate.kv_bytes_per_step(one_to_one.config, "contiguous", mesh) == 6 * full + 6 * window
    llama4 = variants[4]
    assert collectives.halo_exchanges(shape, chunk_size=256, layout="contiguous", block=128) == ()
    chunk = sum(collectives.formula("halo", shape, sliding_window=(255, 0), layout="contiguous",
                                    block=128).values())
    assert 0 < chunk
    assert ablate.kv_bytes_per_step(llama4.config, "contiguous", mesh) == 3 * full + 9 * chunk
    llama4.config.attention.layer_types.local.cp = "something new"
    assert ablate.kv_bytes_per_step(llama4.config, "contiguous", mesh) is None  # not priced: "–"


def test_the_table_gives_the_ruler_average_where_the_grid_asks_for_it(tmp_path):
    """train.eval_ruler_every in a grid makes each run write ruler.json (scripts/train.py hands the
    loop RULER's evaluator); the table then gives each variant's mean score over its seeds, and
    without any ruler.json it has no such column."""
    _, variants = ablation.load_grid(SMOKE)
    steps = variants[0].config.train.num_steps
    for name in ("causal", "sliding_window_64", "no_document_mask"):
        for seed in range(2):
            write_run(tmp_path / name / f"seed_{seed}", steps=steps, train_loss=2.5, val_loss=2.0)
    assert "RULER average" not in ablation.markdown_table(ablation.summarize(variants, str(tmp_path), seeds=2))
    # (causal: 0.2 and 0.4 over its seeds; sliding_window_64: one seed ran it, one run had no cell
    # that fits (mean_score null); no_document_mask: none)
    for name, seed, mean in (("causal", 0, 0.2), ("causal", 1, 0.4), ("sliding_window_64", 0, 0.75),
                             ("sliding_window_64", 1, None)):
        (tmp_path / name / f"seed_{seed}" / "ruler.json").write_text(
            json.dumps({"tasks": ["niah_single_1"], "lengths": [512], "score": [[mean]], "mean_score": mean}))
    rows = {r["variant"]: r for r in ablation.summarize(variants, str(tmp_path), seeds=2)}
    assert rows["causal"]["ruler"] == pytest.approx(0.3) and rows["causal"]["ruler_std"] == pytest.approx(0.1414, abs=1e-4)
    assert rows["sliding_window_64"]["ruler"] == 0.75 and rows["sliding_window_64"]["ruler_std"] is None
    assert rows["no_document_mask"]["ruler"] is None
    table = ablation.markdown_table(list(rows.values()))
    header = next(line for line in table.splitlines() if line.startswith("| variant"))
    column = header.split(" | ").index("RULER average")
    cells = {line.split(" | ")[0][2:]: line.split(" | ")[column] for line in table.splitlines()[2:5]}
    assert cells == {"causal": "0.30 ± 0.14", "sliding_window_64": "0.75", "no_document_mask": "–"}
    assert "RULER average: the mean score over the tasks and lengths" in table
    # the separator row has as many columns as the header
    assert table.splitlines()[1].count("|") == header.count("|")
