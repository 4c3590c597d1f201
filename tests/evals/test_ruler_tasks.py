"""RULER's task generators (longctx.evals.ruler_tasks): every task's answer is in its sample exactly
as the score expects it, at every depth, on every haystack; lengths are exact; needles sit at
their depth; the extraction tasks' answers are what their lists say; samples are seeded."""

import collections
import re

import numpy as np
import pytest

from longctx.data.tokenizer import byte_tokenizer
from longctx.evals import ruler
from longctx.evals import ruler_tasks as rt
from longctx.evals import ruler_words

TOK = byte_tokenizer()
TEXT = " ".join(f"Sentence {i} of the essay talks about {w} and more.\nIt   ends here." for i, w in
                enumerate(ruler_words.NOUNS))
DOCS = [TOK.encode_document(TEXT.encode()), TOK.encode_document(b"A second document. Short!")]
HAY = rt.Haystacks(TOK, DOCS)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _prompt(sample):
    return TOK.decode(sample.tokens[1:len(sample.tokens) - sample.answer_len])


@pytest.mark.parametrize("name", list(rt.TASKS))
@pytest.mark.parametrize("length", [1024, 3000])
def test_every_answer_is_in_place_as_the_score_expects(name, length):
    task = rt.TASKS[name]
    for depth in DEPTHS if task.uses_depth else (None,):
        s = rt.generate(task, HAY, length, depth, np.random.default_rng(7))
        assert s.tokens.dtype == np.int32 and s.tokens[0] == TOK.bos_id
        assert (TOK.bos_id not in s.tokens[1:]) and TOK.eos_id not in s.tokens
        if task.kind in ("niah", "vt"):
            assert len(s.tokens) == length
        else:
            assert length - 40 <= len(s.tokens) <= length  # whole words up to the length
        assert TOK.decode(s.answer) == s.answer_text
        assert ruler.string_match_all(s.answer_text, s.expected) == 1.0
        assert ruler.string_match_all(s.answer_text[:len(s.answer_text) // 2], s.expected) < 1.0
        prompt = _prompt(s)
        for e in s.expected:
            assert e in prompt
        prefix = {"niah": rt.NIAH_ANSWER_PREFIX.split("{")[0], "vt": " Answer: According to the chain(s)",
                  "cwe": " Answer: The top 10 words", "fwe": rt.FWE_ANSWER_PREFIX}[task.kind]
        assert prefix in prompt[-300:]


@pytest.mark.parametrize("name", ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_the_asked_needle_sits_at_its_depth(name, depth):
    """Within one haystack unit (a noise line, an essay sentence, a distractor needle) of depth x
    the haystack, measured in tokens (bytes) of the context."""
    task = rt.TASKS[name]
    s = rt.generate(task, HAY, 2000, depth, np.random.default_rng(3))
    prompt = _prompt(s)
    head = rt.NIAH_TEMPLATE.split("{context}")[0].replace("Some", "A").replace("are", "is").format(
        type_needle_v=task.value_type[:-1])
    assert prompt.startswith(head)
    tail_at = prompt.rindex("\nWhat is the special magic")
    context = prompt[len(head):tail_at]
    needle = re.search(r"One of the special magic \w+ for (\S+) is: " + re.escape(s.expected[0]) + r"\.", context)
    filler = len(context) - len(needle.group(0)) - 2  # (the needle's own separators)
    unit = {"noise": len(rt.NOISE) + 1, "documents": 1, "essay": 70, "needle": 80}[task.haystack]
    assert abs(needle.start() - depth * filler) <= unit + 2, (needle.start(), depth * filler)
    assert f"for {needle.group(1)} mentioned" in prompt[tail_at:]  # the key asked is this needle's


def test_multi_needle_tasks_ask_for_every_value_in_order():
    s = rt.generate(rt.TASKS["niah_multivalue"], HAY, 2000, 0.5, np.random.default_rng(1))
    prompt = _prompt(s)
    assert len(s.expected) == 4 and len(set(s.expected)) == 4
    assert [prompt.index(v) for v in s.expected] == sorted(prompt.index(v) for v in s.expected)
    key = re.search(r"for ([\w-]+) is: " + s.expected[0], prompt).group(1)
    assert all(f"for {key} is: {v}." in prompt for v in s.expected)
    assert s.answer_text == f" {s.expected[0]}, {s.expected[1]}, {s.expected[2]}, and {s.expected[3]}."
    assert "What are all the special magic numbers for " in prompt

    q = rt.generate(rt.TASKS["niah_multiquery"], HAY, 2000, 0.5, np.random.default_rng(1))
    keys = re.search(r"magic numbers for (.*) mentioned in the provided text\?", _prompt(q)).group(1)
    keys = re.split(r", and |, ", keys)
    assert len(keys) == 4
    assert [re.search(f"for {k} is: (\\d+)", _prompt(q)).group(1) for k in keys] == list(q.expected)

    k = rt.generate(rt.TASKS["niah_multikey_1"], HAY, 2000, 0.5, np.random.default_rng(1))
    assert len(re.findall(r"One of the special magic numbers for", _prompt(k))) == 4 and len(k.expected) == 1


def test_variable_tracking_follows_its_chains():
    task = rt.Task("vt_3x2", "vt", "noise", num_chains=3, num_hops=2)
    for depth in DEPTHS:
        s = rt.generate(task, HAY, 1500, depth, np.random.default_rng(5))
        prompt = _prompt(s)
        value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
        holds, found = {}, [v for v in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", prompt)]
        assert len(found) == 9
        for name, source in found:  # in the order they are written, as a reader follows them
            holds[name] = holds[source[4:]] if source.startswith("VAR") else source
        assert sorted(n for n, v in holds.items() if v == value) == sorted(s.expected)
        assert len(s.expected) == 3 and f"{len(s.expected)} variables are assigned the value {value}" in prompt


def test_common_and_frequent_words_answers_are_the_most_frequent():
    s = rt.generate(rt.TASKS["cwe"], HAY, 3000, None, np.random.default_rng(2))
    words = re.findall(r"\d+\. ([\w-]+)", _prompt(s))
    counts = collections.Counter(words)
    assert len(s.expected) == 10
    assert min(counts[w] for w in s.expected) > max(c for w, c in counts.items() if w not in s.expected)
    assert list(s.expected) == sorted(s.expected, key=words.index)  # listed as they first appear

    f = rt.generate(rt.TASKS["fwe"], HAY, 3000, None, np.random.default_rng(2))
    coded = _prompt(f).split("coded words. ")[1].split("\nQuestion")[0].split()
    counts = collections.Counter(coded)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == list(f.expected)
    assert counts[ranked[3]] > counts[ranked[4]]


def test_samples_are_seeded_and_a_length_too_short_says_so():
    a = rt.generate(rt.TASKS["niah_single_2"], HAY, 1000, 0.5, np.random.default_rng(11))
    b = rt.generate(rt.TASKS["niah_single_2"], HAY, 1000, 0.5, np.random.default_rng(11))
    c = rt.generate(rt.TASKS["niah_single_2"], HAY, 1000, 0.5, np.random.default_rng(12))
    assert np.array_equal(a.tokens, b.tokens) and not np.array_equal(a.tokens, c.tokens)
    with pytest.raises(ValueError, match="niah_multikey_1 cannot fit in 300 tokens"):
        rt.generate(rt.TASKS["niah_multikey_1"], HAY, 300, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="the documents haystack needs validation documents"):
        rt.generate(rt.TASKS["niah_single_2"], rt.Haystacks(TOK), 1000, 0.5, np.random.default_rng(0))
    made, skipped = ruler.make_samples(TOK, DOCS, ["niah_single_1", "cwe"], [400, 1200], (0.0, 1.0), 2, seed=0)
    assert sorted(skipped) == [("cwe", 400)] and "cwe cannot fit in 400 tokens" in skipped[("cwe", 400)]
    assert collections.Counter((s.task, s.length) for s in made) == {
        ("niah_single_1", 400): 4, ("niah_single_1", 1200): 4, ("cwe", 1200): 4}
    again, _ = ruler.make_samples(TOK, DOCS, ["cwe", "niah_single_1"], [1200, 400], (0.0, 1.0), 2, seed=0)
    key = lambda s: (s.task, s.length, s.tokens.tobytes())  # noqa: E731  (the same cells, whatever the order asked)
    assert sorted(map(key, made)) == sorted(map(key, again))


def test_word_lists_hold_no_word_inside_another():
    words = ruler_words.SINGLE_WORDS
    assert len(set(words)) == len(words) >= 250
    assert not [(a, b) for a in words for b in words if a != b and a in b]
