"""RULER in a run: train.eval_ruler_every logs ruler/ scores per task and length and writes the
heatmap; scripts/eval_ruler.py evaluates the run's checkpoint and a Hugging Face Llama converted by
scripts/convert_hf.py (untrained models: the plumbing, not the scores; tests/evals/test_ruler_learned.py
has a model that passes), and refuses a command naming no model or two in one sentence."""

import json
import os
import sys

import pytest

from configs import base
from longctx import config as config_lib
from longctx import train
from longctx.evals import ruler
from tests import ROOT as REPO
from tests.validate_commands import ScriptServer, run_scripts

SCRIPT = os.path.join(REPO, "scripts", "eval_ruler.py")
CONVERT = os.path.join(REPO, "scripts", "convert_hf.py")
HF_LLAMA = os.path.join(REPO, "tests", "assets", "hf", "llama_untied")
FIXTURE = os.path.join(REPO, "tests", "fixtures", "checkpoint_2373a90")


@pytest.mark.slow
def test_training_hook_and_eval_script(tmp_path):
    config = base.get_config("tiny")
    config.unlock()
    config.model.update(d_model=64, mlp_dim=128, head_dim=16)
    config.train.update(num_steps=2, log_every=1, eval_every=0, loss_chunk_size=128, eval_ruler_every=2)
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir, evaluators=[ruler.RULER_EVALUATOR])
    logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rows = [row for row in logged if "ruler/score" in row]
    assert [row["step"] for row in rows] == [2]
    assert 0.0 <= rows[0]["ruler/score"] <= 1.0
    assert {"ruler/niah_single_1", "ruler/niah_single_1/1024", "ruler/vt/1024"} <= set(rows[0])
    result = json.load(open(os.path.join(workdir, "ruler.json")))
    assert result["lengths"] == [256, 512, 1024] and result["tasks"] == list(ruler.TrainingEvaluator.TASKS)
    assert result["tokenizer_name"] == "byte" and result["step"] == 2
    assert "niah_single_1@256" in result["not_run"]  # its template alone is longer than 256 bytes
    assert os.path.isfile(os.path.join(workdir, "ruler.png"))

    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    out = str(tmp_path / "eval")
    done = ScriptServer.run([sys.executable, SCRIPT, f"--workdir={workdir}", f"--out={out}", "--depths=2",
                             "--samples=1", "--tasks=niah_single_2,niah_multikey_2,vt", "--lengths=512,1024"],
                            cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "eval_ruler: mean score" in done.stdout and "eval_ruler: vt " in done.stdout
    result = json.load(open(os.path.join(out, "ruler.json")))
    assert result["step"] == 2 and result["depths"] == [0.0, 1.0] and result["lengths"] == [512, 1024]
    assert result["tasks"] == ["niah_single_2", "niah_multikey_2", "vt"] and result["seed"] == 0
    assert result["haystack"] == {"niah_single_2": "documents", "niah_multikey_2": "needle", "vt": "noise"}
    assert result["tokenizer"] == "byte" and result["tokenizer_name"] == "byte"
    assert os.path.isfile(os.path.join(out, "ruler.png"))


@pytest.mark.slow
def test_eval_script_on_a_converted_hf_llama(tmp_path):
    """The tiny HF Llama fixture (tests/assets/hf/llama_untied, 512 ids, no tokenizer of its own)
    through convert_hf.py to-longctx, then eval_ruler.py --checkpoint with the byte tokenizer (its
    259 ids fit the model's 512) on the ring (1x2x4, xla), as docs/ruler.md prints it."""
    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    converted, out = str(tmp_path / "llama_hf"), str(tmp_path / "ruler")
    done = ScriptServer.run([sys.executable, CONVERT, "to-longctx", f"--hf={HF_LLAMA}", f"--out={converted}"],
                            cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    done = ScriptServer.run([sys.executable, SCRIPT, f"--checkpoint={converted}", "--tokenizer=byte", "--mesh=1,2,4",
                             "--impl=xla", "--seq-len=512", "--tasks=niah_single_1,niah_multikey_2", "--lengths=512",
                             "--depths=2", "--samples=1", f"--out={out}"],
                            cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "eval_ruler: niah_multikey_2 " in done.stdout and "eval_ruler: mean score" in done.stdout
    result = json.load(open(os.path.join(out, "ruler.json")))
    assert result["model"] == converted and result["step"] == 0
    assert result["tokenizer"] == "byte" and result["tokenizer_from"] == "--tokenizer"
    assert result["mesh"] == {"dp": 1, "fsdp": 2, "sp": 4} and result["attention_impl"] == "xla"
    assert result["tasks"] == ["niah_single_1", "niah_multikey_2"] and result["lengths"] == [512]
    assert result["samples_per_cell"] == 2 and result["not_run"] == {}
    assert all(0.0 <= v <= 1.0 for row in result["score"] for v in row)
    assert os.path.isfile(os.path.join(out, "ruler.png"))


def test_eval_ruler_names_one_model(tmp_path):
    started = tmp_path / "run"
    (started / "checkpoints").mkdir(parents=True)
    results = run_scripts([[SCRIPT], [SCRIPT, f"--workdir={started}", f"--checkpoint={started}"],
                           [SCRIPT, f"--checkpoint={tmp_path / 'nowhere'}", "--validate_only"],
                           [SCRIPT, f"--workdir={started}", "--tasks=niah_single_1,passkey"]])
    lines = ["longctx: name the model with one of --workdir=RUN or --checkpoint=DIR.",
             "longctx: name the model with one of --workdir=RUN or --checkpoint=DIR.",
             f"longctx: --checkpoint='{tmp_path / 'nowhere'}' does not exist."]
    for result, line in zip(results, lines):
        assert result["returncode"] == 2, result
        assert (result["stdout"] + result["stderr"]).strip().splitlines() == [line], result
    assert results[3]["returncode"] == 2 and "'passkey' is not a RULER task" in results[3]["stderr"]


def test_lengths_no_task_fits_are_refused_and_nothing_is_written(tmp_path):
    """One line, exit status 2, and the earlier ruler.json and ruler.png as they were (not empty
    ones). (The 2373a90 fixture's model, byte tokenizer: niah's template alone is over 256 bytes.)"""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ruler.json").write_text("earlier")
    (out / "ruler.png").write_text("earlier")
    (result,) = run_scripts([[SCRIPT, f"--checkpoint={FIXTURE}", "--tokenizer=byte", "--lengths=128,256",
                              "--tasks=niah_single_1,niah_multikey_1", "--samples=1", "--depths=1",
                              f"--out={out}"]])
    assert result["returncode"] == 2, result
    assert result["stderr"].strip().splitlines() == [
        "longctx: no RULER task of niah_single_1, niah_multikey_1 fits in 128, 256 tokens: niah_single_1 cannot "
        "fit in 256 tokens of this tokenizer (its template, needles and answer take 359); ask for longer "
        "--lengths (up to the model's sequence length, or --seq-len) or other --tasks."], result
    assert (out / "ruler.json").read_text() == (out / "ruler.png").read_text() == "earlier"
    assert sorted(p.name for p in out.iterdir()) == ["ruler.json", "ruler.png"]


def test_the_ruler_hook_without_its_evaluator_is_one_sentence_before_any_compile(tmp_path):
    config = base.get_config("tiny")
    config.unlock()
    config.train.eval_ruler_every = 3
    with pytest.raises(config_lib.ConfigError) as e:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(e.value) == (
        "train.eval_ruler_every=3 needs its evaluator: pass evaluators=[longctx.evals.ruler.RULER_EVALUATOR] "
        "to train_and_evaluate (scripts/train.py does), or set train.eval_ruler_every=0.")
    config.train.eval_ruler_every = -1
    with pytest.raises(config_lib.ConfigError, match=r"train.eval_ruler_every=-1 must be >= 0"):
        config_lib.validate(config)
