"""Passkey retrieval: haystacks, greedy exact-match scoring, and a model that retrieves across the ring.

The retrieval test trains the tiny model (the real train_step, 8 CPU devices, mesh 1x2x4, ring
over sp=4, zigzag, 128-token rows) on the synthetic task of benchmarks/needle_synthetic.py: the needle (a marker
and a value token, 10 values, chance = 0.1) always sits on another ring shard than the question,
so a right answer needs keys and values that came around the ring. Seeded data and a
deterministic CPU backend make it the same run every time. Measured on 128 held-out rows after
200 steps, for training seeds 0 (the test), 1, 2, 3: cross-shard 1.00, 1.00, 0.91, 1.00; the
same rows with the needle in the previous document 0.05, 0.15, 0.14, 0.04 (chance 0.10); and
with use_segment_ids=False the cross-document rows are answered again (the document mask is the
only thing that hides the needle). The thresholds (>= 0.75, <= 0.25) hold for every seed tried.
~45 s on 2 cores.
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx import train
from longctx.data.tokenizer import byte_tokenizer
from longctx.evals import needle
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from tests import ROOT as REPO
from tests.validate_commands import ScriptServer, run_scripts

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the synthetic task lives with its benchmark

import needle_synthetic as synthetic  # noqa: E402

NUM_VALUES = synthetic.SYNTHETIC_NUM_VALUES
SEQ_LEN = 128


def test_retrieval_crosses_the_ring_and_stops_at_documents():
    config = base.get_config("tiny")
    config_lib.apply_overrides(config, synthetic.SYNTHETIC_OVERRIDES)
    # 200 steps: LLVM level 1 (not the suite's 0, tests/conftest.py) runs them faster than it compiles slower
    runner = synthetic.train_synthetic(config, seed=0, compiler_options={"xla_backend_optimization_level": 1})
    assert dict(runner.mesh.shape) == {"dp": 1, "fsdp": 2, "sp": 4} and runner.layout == "zigzag"
    found = synthetic.synthetic_report(runner)
    print(f"retrieval accuracy: cross-shard {found['cross_shard']:.2f}, cross-document "
          f"{found['cross_document']:.2f}, cross-document without the document mask "
          f"{found['cross_document_without_mask']:.2f} (chance {found['chance']:.2f})")
    assert found["cross_shard"] >= 0.75
    assert found["cross_document"] <= 0.25
    assert found["cross_document_without_mask"] >= 0.75


def test_synthetic_needle_is_on_another_shard_than_the_question():
    rows = synthetic.synthetic_rows(np.random.default_rng(0), 64, SEQ_LEN, 64, num_values=NUM_VALUES, sp=4,
                                 layout="zigzag", split_documents=True)
    shard = np.empty(SEQ_LEN, int)
    for d, positions in enumerate(layout_lib.shard_positions("zigzag", SEQ_LEN, 4)):
        shard[positions] = d
    q = rows["question_at"]
    for b in range(64):
        p = int(np.nonzero(rows["tokens"][b] == synthetic.NEEDLE_MARK)[0][0])
        assert rows["tokens"][b, p + 1] == rows["answers"][b] == rows["targets"][b, q]
        assert shard[p] != shard[q] and shard[p + 1] != shard[q]
        assert rows["segment_ids"][b, p + 1] == 1 and rows["segment_ids"][b, q] == 2
        assert rows["positions"][b, q] < q  # the question's document restarts its positions
    assert rows["loss_mask"].sum() == 64 and rows["loss_mask"][:, q].all()


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_haystack(depth):
    tok = byte_tokenizer()
    filler = np.frombuffer(b"grass is green. " * 100, np.uint8).astype(np.int32)
    h = needle.passkey_haystack(tok, filler, 400, depth, "40917", offset=3)
    text = bytes(int(t) for t in h.tokens[1:]).decode()
    assert len(h.tokens) == 400 and h.tokens[0] == tok.bos_id
    assert text.endswith(needle.QUESTION + " 40917")
    assert bytes(h.answer.tolist()).decode() == " 40917"
    needle_text = needle.NEEDLE.format(key="40917")
    at = text.index(needle_text)
    filler_len = 400 - 1 - len(needle_text) - len(needle.QUESTION) - len(" 40917")
    assert at == round(depth * filler_len)
    assert text[:at] == ("grass is green. " * 100)[3:3 + at]


class OracleRunner:
    """A stand-in model that predicts every token right, except digits at positions in `wrong`."""

    def __init__(self, seq_len=512, batch=2, wrong=()):
        self.config = base.get_config("tiny")
        self.config.data.seq_len, self.config.data.global_batch_size = seq_len, batch
        self.layout, self.mesh, self.wrong = "zigzag", mesh_lib.make_mesh(self.config.mesh), set(wrong)
        self.asked = []

    def logits_at(self, rows, where):
        self.asked.append(np.asarray(where).copy())
        nxt = np.take_along_axis(np.roll(rows["tokens"], -1, axis=1), where, axis=1)
        for b, p in self.wrong:
            nxt[b, p] = (nxt[b, p] + 1) % 512
        return np.eye(512, dtype=np.float32)[nxt]


def test_greedy_exact_match_asks_for_the_answer_positions():
    tok = byte_tokenizer()
    filler = np.arange(97, 123, dtype=np.int32)
    stacks = [needle.passkey_haystack(tok, filler, n, 0.5, key) for n, key in
              [(300, "11111"), (512, "22222"), (200, "33333")]]
    oracle = OracleRunner()
    assert needle.answer_correct(oracle, stacks).tolist() == [True, True, True]
    # Position 5 of the first batch's second row: one digit of "22222" predicted wrong.
    assert needle.answer_correct(OracleRunner(wrong=[(1, 5)]), stacks).tolist() == [True, False, True]
    first = oracle.asked[0]
    assert first[0, 0] == 300 - 7 and first[0, -1] == 300 - 2  # predicts tokens 294..299 (" 11111")


def test_evaluate_writes_json_and_heatmap(tmp_path):
    tok = byte_tokenizer()
    docs = [tok.encode_document(b"def f(x):\n    return x + 1\n" * 20)]
    result = needle.evaluate(OracleRunner(), tok, docs, depths=(0.0, 0.5, 1.0), samples=2)
    assert result["lengths"] == [256, 512] and result["mean_accuracy"] == 1.0
    json_path, png_path = needle.write_results(result, str(tmp_path))
    assert json.load(open(json_path))["accuracy"] == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert open(png_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_training_hook_and_eval_script(tmp_path):
    """train.eval_needle_every logs needle/accuracy and writes the heatmap; scripts/eval_needle.py
    evaluates the run's checkpoint (an untrained model: the plumbing, not the accuracy)."""
    config = base.get_config("tiny")
    config.unlock()
    config.model.update(d_model=64, mlp_dim=128, head_dim=16)
    config.data.update(seq_len=512, global_batch_size=2)
    config.attention.block_size = 64
    config.train.update(num_steps=2, log_every=1, eval_every=0, loss_chunk_size=128, eval_needle_every=2)
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir, evaluators=[needle.PASSKEY_EVALUATOR])
    logged = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    needle_rows = [row for row in logged if "needle/accuracy" in row]
    assert [row["step"] for row in needle_rows] == [2]
    assert needle_rows[0]["needle/lengths"] == [256, 512]
    assert os.path.isfile(os.path.join(workdir, "needle.png"))

    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    out = str(tmp_path / "eval")
    done = ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "eval_needle.py"), f"--workdir={workdir}",
                             f"--out={out}", "--depths=3", "--samples=1"],
                            cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "eval_needle: mean accuracy" in done.stdout
    result = json.load(open(os.path.join(out, "needle.json")))
    assert result["step"] == 2 and result["depths"] == [0.0, 0.5, 1.0] and result["layout"] == "zigzag"
    assert os.path.isfile(os.path.join(out, "needle.png"))


def test_the_needle_hook_without_its_evaluator_is_one_sentence_before_any_compile(tmp_path):
    """train_and_evaluate called directly with train.eval_needle_every and no evaluator given."""
    config = base.get_config("tiny")
    config.unlock()
    config.train.eval_needle_every = 2
    with pytest.raises(config_lib.ConfigError) as e:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(e.value) == (
        "train.eval_needle_every=2 needs its evaluator: pass "
        "evaluators=[longctx.evals.needle.PASSKEY_EVALUATOR] to train_and_evaluate (scripts/train.py "
        "does), or set train.eval_needle_every=0.")
    assert not (tmp_path / "run").exists()  # failed before the workdir, the data or a compile


def run_eval_needle(*args):
    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    return ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "eval_needle.py"), *map(str, args)],
                            cwd=REPO, env=env, timeout=600)


@pytest.mark.slow
def test_eval_needle_reads_a_converted_model_with_its_own_tokenizer(tmp_path):
    """A Hugging Face model converted with convert_hf.py (whose saved config names no dataset):
    the haystacks are tokenized with the tokenizer.json of the directory it came from, the
    embedded corpus's byte ids decoded and encoded again, and needle.json says so. Without a
    tokenizer to be found, one sentence asks for --tokenizer (the byte ids of the embedded
    corpus would be read as the model's own ids)."""
    from tests.data.test_hf_tokenizer import build_tokenizer

    hf_dir = tmp_path / "hf"
    shutil.copytree(os.path.join(REPO, "tests", "assets", "hf", "llama3_scaling"), hf_dir)
    build_tokenizer(hf_dir, config={"bos_token": "<s>", "eos_token": "</s>"})
    converted = tmp_path / "converted"
    env = {**os.environ, "LONGCTX_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    done = ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), "to-longctx",
                             f"--hf={hf_dir}", f"--out={converted}"], cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    small = ["--seq-len=256", "--lengths=256", "--depths=2", "--samples=1", "--mesh=1,2,4", "--impl=xla"]

    done = run_eval_needle(f"--workdir={converted}", f"--out={tmp_path / 'eval'}", *small)
    assert done.returncode == 0, done.stderr
    result = json.load(open(tmp_path / "eval" / "needle.json"))
    assert result["tokenizer"] == f"hf:{hf_dir}" and result["tokenizer_name"] == "hf:tokenizer.json"
    assert result["tokenizer_from"] == "the converted model's Hugging Face directory"
    assert result["data_tokenizer"] == "byte" and result["filler_retokenized"] is True

    os.remove(hf_dir / "tokenizer.json")
    done = run_eval_needle(f"--workdir={converted}", *small)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"longctx: --workdir={converted} holds a converted Hugging Face model and no tokenizer.json was "
        "found beside it or in the directory it was converted from; pass --tokenizer=hf:DIR (the "
        "model's tokenizer).")

    done = run_eval_needle(f"--workdir={converted}", "--seq-len=256", "--lengths=512")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "longctx: --lengths=512 is longer than the 256-token sequences the model runs at; pass "
        "--seq-len=512 as well.")


def test_eval_needle_on_a_run_without_a_checkpoint_names_the_workdir(tmp_path):
    """A run that has not saved yet (or a workdir that does not exist): one sentence naming
    --workdir and what to do, not checkpoint.init_from, a key the user never set."""
    started = tmp_path / "run"
    (started / "checkpoints").mkdir(parents=True)
    (started / "metrics.jsonl").write_text("")
    script = os.path.join(REPO, "scripts", "eval_needle.py")
    results = run_scripts([[script, f"--workdir={started}"], [script, f"--workdir={started}", "--validate_only"],
                           [script, f"--workdir={tmp_path / 'nowhere'}"]])
    no_checkpoint = (f"longctx: --workdir='{started}' holds no complete checkpoint yet (a run saves one every "
                     "checkpoint.every_steps steps and when it stops): name it once its run has saved one, or "
                     "name a directory that holds one.")
    for result, line in zip(results, [no_checkpoint, no_checkpoint,
                                      f"longctx: --workdir='{tmp_path / 'nowhere'}' does not exist."]):
        assert result["returncode"] == 2, result
        assert (result["stdout"] + result["stderr"]).strip().splitlines() == [line], result
