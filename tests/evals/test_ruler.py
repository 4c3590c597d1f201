"""RULER's scoring (longctx.evals.ruler): string_match_all on hand-made answers; teacher forcing
packs samples as documents and reads each answer's argmaxes; on a tiny model the teacher-forced
argmaxes are a token-by-token greedy decode's, for 50 samples whose answers agree with greedy
decoding for 0..k tokens; the evaluation writes ruler.json and its heatmap."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.data.tokenizer import byte_tokenizer
from longctx.evals import inference
from longctx.evals import ruler
from longctx.evals import ruler_tasks as rt
from longctx.parallel import mesh as mesh_lib

TOK = byte_tokenizer()
DOCS = [TOK.encode_document(b"The river runs to the sea. Birds fly south in winter. " * 40)]


@pytest.mark.parametrize("prediction, expected, score", [
    (" 1234567.", ["1234567"], 1.0),
    (" 1234567, 7654321, and 1111111.", ["1234567", "7654321", "2222222"], 2 / 3),
    ("The special magic numbers are 123.", ["1234567"], 0.0),  # a part of a value is not the value
    (" 1. APPLE 2. Mango", ["apple", "mango", "tiger", "lemon"], 0.5),  # case folded, as RULER does
    ("", ["x"], 0.0),
    (" WQNHI BBAEV QXNPZ SQOOY HVRAK", ["HVRAK", "WQNHI"], 1.0),  # order does not matter to the score
])
def test_string_match_all_on_hand_made_answers(prediction, expected, score):
    assert ruler.string_match_all(prediction, expected) == pytest.approx(score)


def test_pack_fills_rows_first_fit_decreasing():
    assert ruler.pack([300, 700, 500, 200, 1000], 1000, True) == [[4], [1, 0], [2, 3]]
    assert ruler.pack([300, 700], 1000, False) == [[1], [0]]
    with pytest.raises(ValueError, match="a sample of 1001 tokens is longer than data.seq_len=1000"):
        ruler.pack([1001], 1000, True)


class OracleRunner:
    """A stand-in model that predicts every next token of its rows, except at (call, row, column)
    `wrong` (column: of the positions asked for)."""

    def __init__(self, seq_len=2048, batch=2, wrong=(), use_segment_ids=True):
        self.config = base.get_config("tiny")
        self.config.data.seq_len, self.config.data.global_batch_size = seq_len, batch
        self.config.attention.use_segment_ids = use_segment_ids
        self.layout, self.mesh, self.wrong = "zigzag", mesh_lib.make_mesh(self.config.mesh), set(wrong)
        self.rows = []

    def logits_at(self, rows, where):
        self.rows.append(rows)
        nxt = np.take_along_axis(np.roll(rows["tokens"], -1, axis=1), where, axis=1)
        for call, b, p in self.wrong:
            if call == len(self.rows) - 1:
                nxt[b, p] = (nxt[b, p] + 1) % 512
        return np.eye(512, dtype=np.float32)[nxt]


def test_teacher_forcing_packs_samples_and_finds_where_answers_depart():
    samples, skipped = ruler.make_samples(TOK, DOCS, ["niah_single_1", "niah_multivalue", "vt"], [500, 900],
                                          (0.0, 1.0), 1, seed=0)
    assert list(skipped) == [("niah_multivalue", 500)] and len(samples) == 10
    oracle = OracleRunner()
    found = ruler.teacher_forced(oracle, samples)
    assert all(f.agreed == s.answer_len and np.array_equal(f.argmax, s.answer) for s, f in zip(samples, found))
    rows = oracle.rows[0]
    # 6 samples of 900 tokens two to a 2,048-token row, 4 of 500 in one, padding (segment 0) after
    # them: 4 rows, 2 batches of 2
    assert len(oracle.rows) == 2 and rows["tokens"].shape == (2, 2048)
    assert sorted(np.unique(rows["segment_ids"][0]).tolist()) == [0, 1, 2]
    assert sorted(np.unique(oracle.rows[1]["segment_ids"][1]).tolist()) == [0, 1, 2, 3, 4]
    first = rows["segment_ids"][0] == 1
    assert rows["positions"][0][first].tolist() == list(range(int(first.sum())))

    # The oracle errs at the 3rd answer token of the first row's first sample (a 900-token one).
    placed = ruler.pack([len(s.tokens) for s in samples], 2048, True)
    i = placed[0][0]
    found = ruler.teacher_forced(OracleRunner(wrong=[(0, 0, 2)]), samples)
    assert found[i].agreed == 2 and all(f.agreed == s.answer_len for j, (s, f) in
                                        enumerate(zip(samples, found)) if j != i)
    text = ruler.greedy_text(TOK, samples[i], found[i])
    assert text == samples[i].answer_text[:2]

    alone = OracleRunner(use_segment_ids=False)
    ruler.teacher_forced(alone, samples)
    assert sum(len(r["tokens"]) for r in alone.rows) == 10  # one sample per row without document masks


def test_evaluate_scores_tasks_by_length_and_writes_the_heatmap(tmp_path):
    result = ruler.evaluate(OracleRunner(), TOK, DOCS, tasks=["niah_single_2", "cwe", "fwe"],
                            lengths=[400, 1500], depths=(0.0, 0.5), samples=1)
    assert result["score"] == [[1.0, 1.0], [None, 1.0], [None, 1.0]]
    assert list(result["not_run"]) == ["cwe@400", "fwe@400"] and result["mean_score"] == 1.0
    assert result["score_by_depth"] == {"niah_single_2": [[1.0, 1.0], [1.0, 1.0]]}
    assert result["haystack"]["niah_single_2"] == "documents" and result["tokenizer_name"] == "byte"
    json_path, png_path = ruler.write_results(result, str(tmp_path))
    assert json.load(open(json_path))["score"][1] == [None, 1.0]
    assert open(png_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


SMALL = {"mesh.dp": 1, "mesh.fsdp": 2, "mesh.sp": 4, "model.vocab_size": 259, "model.d_model": 64,
         "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
         "model.mlp_dim": 128, "attention.block_size": 64, "data.seq_len": 1024,
         "data.global_batch_size": 2, "train.loss_chunk_size": 128}


def _greedy(runner, prompts: np.ndarray, steps: int, width: int) -> np.ndarray:
    """Token-by-token greedy decoding: `steps` forward passes, each appending the argmax at the
    last position of every (equal-length) prompt. (It asks for that position `width` times: the
    shape teacher forcing asks for, so both run one compiled program.)"""
    rows, out = prompts.copy(), []
    for _ in range(steps):
        n = rows.shape[1]
        nxt = runner.logits_at({"tokens": rows}, np.full((len(rows), width), n - 1))[:, 0].argmax(-1)
        out.append(nxt)
        rows = np.concatenate([rows, nxt[:, None].astype(np.int32)], axis=1)
    return np.stack(out, axis=1)


def test_teacher_forced_argmax_is_greedy_decoding_on_a_tiny_model():
    """50 samples (3 needle tasks, 500 tokens, answers of 9 tokens) on an untrained tiny model
    (one layer), mesh 1x2x4 (the ring over sp=4). Each sample's answer is replaced by what greedy decoding
    says for its first j tokens (j = 0..9) and a different token after, so teacher forcing must
    find exactly j agreeing tokens, and its argmax there must be greedy decoding's next token.
    Teacher forcing packs two samples to a 1,024-token row; greedy decoding runs each alone.
    (A batch of 50 rows: one forward pass of teacher forcing, 9 of greedy decoding, one compile.)"""
    config = base.get_config("tiny")
    # One layer of two heads: the ring and the packing are the same, the forward passes 3x cheaper
    config_lib.apply_overrides(config, {**SMALL, "data.global_batch_size": 50, "model.num_layers": 1,
                                        "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 32})
    runner = inference.make_runner(config, lambda *_: None)
    with jax.set_mesh(runner.mesh):
        params = runner.setup.init(jax.random.PRNGKey(0)).params
    runner = dataclasses.replace(runner, params=params)

    made, _ = ruler.make_samples(TOK, DOCS, ["niah_single_1", "niah_single_2", "niah_multikey_2"], [500],
                                 (0.0, 0.25, 0.5, 0.75, 1.0), 4, seed=0)
    made = made[:50]
    k = made[0].answer_len
    assert len(made) == 50 and {s.answer_len for s in made} == {k} and {len(s.tokens) for s in made} == {500}
    prompts = np.stack([s.tokens[:-k] for s in made])
    greedy = _greedy(runner, prompts, k, width=2 * k)

    forced = []
    for i, s in enumerate(made):
        j = i % (k + 1)
        answer = greedy[i].copy()
        answer[j:] = (greedy[i, j:] + 1) % 256  # departs from greedy decoding at token j
        forced.append(dataclasses.replace(s, tokens=np.concatenate([prompts[i], answer]).astype(np.int32)))
    found = ruler.teacher_forced(runner, forced)
    assert [f.agreed for f in found] == [i % (k + 1) for i in range(50)]
    for i, f in enumerate(found):
        j = f.agreed
        assert np.array_equal(f.argmax[:min(j + 1, k)], greedy[i, :min(j + 1, k)])
    assert len({tuple(g) for g in greedy}) > 1  # answers that differ: the model reads its prompts
