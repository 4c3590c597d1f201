"""A 3-source mixture trains on 8 virtual devices through train_and_evaluate: the achieved shares at
start-up and in run_info.json, each source's validation loss in metrics.jsonl and the final line,
and a resume under changed weights says so in its resume line and goes on."""

import json
import os

import pytest

from configs import base
from longctx.train import loop
from tests.data.mixture_sources import WEIGHTS, prepare_sources


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory):
    return prepare_sources(tmp_path_factory.mktemp("mixture_sources"))


def _config(source_dirs, weights, num_steps):
    c = base.get_config("tiny")
    c.model.update(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.update(seq_len=512, global_batch_size=2)
    c.train.update(num_steps=num_steps, log_every=1, eval_every=2, eval_steps=1, loss_chunk_size=128)
    c.optimizer.update(warmup_steps=0)
    c.checkpoint.update(every_steps=2, async_save=False)
    with c.unlocked():
        c.data.sources = {n: {"path": source_dirs[n], "weight": w} for n, w in weights.items()}
    return c


def test_a_mixture_trains_reports_its_shares_and_evaluates_each_source(source_dirs, tmp_path, capsys):
    workdir = str(tmp_path / "run")
    result = loop.train_and_evaluate(_config(source_dirs, WEIGHTS, 2), workdir)
    out = capsys.readouterr().out
    info = json.load(open(os.path.join(workdir, "run_info.json")))
    shares = info["data_mixture"]
    assert set(shares) == set(WEIGHTS)
    for name, weight in WEIGHTS.items():
        assert shares[name]["weight"] == weight and abs(shares[name]["share"] - weight) < 0.01
    assert "longctx: data mixture by tokens over the first 200 rows: books " in out
    # The start-up line names the mixture, not its first source's directory as the run's data.
    (start,) = [line for line in out.splitlines() if " process(es), " in line]
    assert start.endswith("params, data mixture of 3 sources (books, code, web: data.sources)"), start
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    val = [r for r in records if "val/loss" in r][-1]
    for name in WEIGHTS:
        assert val[f"val/{name}/loss"] > 0
    assert val["val/loss"] == pytest.approx(sum(w * val[f"val/{n}/loss"] for n, w in WEIGHTS.items()))
    assert result["val_books/loss"] == val["val/books/loss"]
    final = [line for line in out.splitlines() if line.startswith("longctx: finished")][0]
    assert ", books " in final and ", code " in final and ", web " in final

    # Resumed under other weights: one phrase on the resume line, and the run goes on.
    loop.train_and_evaluate(_config(source_dirs, {"books": 0.2, "code": 0.3, "web": 0.5}, 4), workdir)
    out = capsys.readouterr().out
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and resumed[0].endswith(
        "data iterator included; the data mixture changed: weights books 0.5 -> 0.2, web 0.2 -> 0.5; "
        "books, code, web continue where they were; the mixer counts tokens afresh at the new weights"), resumed
    assert "longctx: finished" in out
