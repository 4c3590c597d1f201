"""RULER's scoring is not a no-op: a tiny model trained on two of its tasks (benchmarks/ruler_synthetic.py:
niah_single_1 and niah_multikey_2 as ruler_tasks generates them, a word tokenizer whose digits are
tokens of their place in the number) answers them after training and not before.

The model (tiny at d=128, 128-token rows, mesh 1x2x4, ring over sp=4) is trained with the real
train_step and scored on samples of another seed through longctx.evals.ruler, as every run is.
An answer is seven digits to copy from the needle; the model learns the places one after another.

- test_answers_come_from_the_needle_after_training (in make test): 100 steps. What is measured is
  ruler.teacher_forced's `agreed`, the answer tokens greedy decoding reproduces, on which every
  RULER score is built: before training no sample's answer starts right; after, nearly every one
  gets its space and the number's first digit (chance 0.1 once the model knows a digit comes),
  read from the needle. The whole number, which the score asks for, takes longer. Measured on the
  96 samples: 0 of 96 with 2 or more tokens before training, 87 of 96 after (threshold 0.8; 89 after
  150 steps; 35% after 60).
- test_ruler_scores_rise_to_one (LONGCTX_EXHAUSTIVE=1): 1,000 steps (469 s on the 2 busy cores),
  the RULER scores themselves. Measured for seed 0 (benchmarks/bench_ruler.py, docs/ruler.md):
  niah_single_1 1.00 at 96 and 128 tokens, niah_multikey_2 1.00 at 96 and 0.35 at 128; untrained
  0.00 everywhere.
"""

import os
import sys

import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.evals import ruler
from tests import ROOT as REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the synthetic task lives with its benchmark

import ruler_synthetic as synthetic  # noqa: E402

SHORT_STEPS = 100


def synthetic_config(steps: int):
    config = base.get_config("tiny")
    config_lib.apply_overrides(config, {**synthetic.RULER_OVERRIDES, "train.num_steps": steps})
    return config


def test_answers_come_from_the_needle_after_training():
    config = synthetic_config(SHORT_STEPS)
    made, _ = ruler.make_samples(synthetic.word_tokenizer(), None, synthetic.TASKS, synthetic.LENGTHS,
                                 (0.0, 0.5, 1.0), 8, synthetic.EVAL_SEED)
    assert len(made) == 2 * 2 * 3 * 8
    before = np.array([f.agreed for f in ruler.teacher_forced(synthetic.untrained(config, seed=0), made)])
    # LLVM level 1 (not the suite's 0, tests/conftest.py) runs them faster than it compiles slower
    runner = synthetic.train(config, seed=0, compiler_options={"xla_backend_optimization_level": 1})
    after = np.array([f.agreed for f in ruler.teacher_forced(runner, made)])
    print(f"answer tokens greedy decoding reproduces, of {made[0].answer_len}: before training "
          f"{np.bincount(before, minlength=10).tolist()}, after {SHORT_STEPS} steps "
          f"{np.bincount(after, minlength=10).tolist()} (counts of samples by tokens reproduced)")
    assert np.mean(before >= 2) <= 0.1
    assert np.mean(after >= 2) >= 0.8


@pytest.mark.skipif(not os.environ.get("LONGCTX_EXHAUSTIVE"), reason="1,000 training steps: LONGCTX_EXHAUSTIVE=1")
def test_ruler_scores_rise_to_one():
    config = synthetic_config(1000)
    untrained = synthetic.score(synthetic.untrained(config, seed=0))
    trained = synthetic.score(synthetic.train(config, seed=0, compiler_options={"xla_backend_optimization_level": 1}))
    print(f"RULER scores (rows {trained['tasks']}, columns {trained['lengths']}): untrained {untrained['score']}, "
          f"after 1,000 steps {trained['score']}")
    assert untrained["mean_score"] == 0.0
    single, multikey = trained["score"]
    assert min(single) >= 0.9
    assert multikey[0] >= 0.9  # at 96 tokens; at 128 (more distractor needles) it is lower


def test_the_word_tokenizer_round_trips_and_gives_each_digit_its_place():
    tok = synthetic.word_tokenizer()
    text = "One of the special magic numbers for brave-eagle is: 1234567.\nThe grass is green. VAR QXZKW = 70511"
    assert tok.decode(tok.encode(text.encode())) == text
    assert [tok.pieces[i] for i in tok.encode(b"is: 31135")] == ["is", ":", " ", "3@0", "1@1", "1@2", "3@3", "5@4"]
    assert tok.vocab_size == synthetic.RULER_OVERRIDES["model.vocab_size"]


def test_training_rows_hold_whole_samples_with_the_loss_on_their_answers():
    tok = synthetic.word_tokenizer()
    rows = synthetic.training_rows(np.random.default_rng(0), synthetic.ruler_tasks.Haystacks(tok), 8, 128,
                                   synthetic.LENGTHS)
    for r in range(8):
        seg = rows["segment_ids"][r]
        assert seg[0] == 1 and np.all(np.diff(seg[seg > 0]) >= 0)
        for doc in np.unique(seg[seg > 0]):
            at = np.nonzero(seg == doc)[0]
            assert len(at) in synthetic.LENGTHS and rows["positions"][r, at].tolist() == list(range(len(at)))
            text = tok.decode(rows["tokens"][r, at])
            asked = text.split("The special magic number for ")[-1].split(" mentioned")[0]
            value = text.split(f"numbers for {asked} is: ")[1].split(".")[0]  # the needle with the asked key
            answer = rows["targets"][r, at][rows["loss_mask"][r, at] == 1]
            assert tok.decode(answer) == f" {value}." and text.endswith(f" is {value}.")
