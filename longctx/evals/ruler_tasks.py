"""RULER's synthetic tasks (Hsieh et al. 2024, github.com/NVIDIA/RULER) as rows of token ids of a
run's tokenizer, at any length and needle depth, seeded, with no download.

A sample is one document: BOS, the task's prompt (RULER's template with the context in it, then
its answer prefix), then the answer, which scoring teacher-forces (longctx.evals.ruler):

  BOS  template head  context (haystack with needles)  template tail + answer prefix  answer

Tasks (TASKS; RULER's names and settings, with our haystacks):
  niah_single_1/2/3    one needle "One of the special magic numbers for KEY is: VALUE." in
                       noise sentences / the validation documents / essay text (value: a 7-digit
                       number, a uuid for _3)
  niah_multikey_1/2/3  four needles, one asked for; the haystack essay text (_1) or nothing but
                       other needles (_2 numbers, _3 uuid keys and values)
  niah_multivalue      one key with four values; niah_multiquery: four keys asked at once
  vt                   variable tracking: chains of "VAR X = VAR Y" (num_chains, num_hops) in noise;
                       the answer is every variable holding the first chain's value
  cwe                  common-word extraction: a numbered list where 10 words are frequent
  fwe                  frequent-word extraction: coded words with Zipf counts; the three most frequent

Haystacks (RULER's "repeat", "essay" and "needle", the essay text from the run's own data):
  noise      RULER's sentences "The grass is green. ..." repeated, one per line
  documents  the validation documents' token ids as stored, joined, from a random offset
  essay      the documents' text with whitespace folded (as RULER treats its essays), cut into
             sentences and repeated as often as the length needs; needles go between sentences
  needle     nothing but distractor needles
Needles go only at unit boundaries (between lines or sentences; anywhere in documents). The
needle a question asks for first (and the first statement of the asked chain) sits at `depth`
of the haystack (0 = first, 1 = last); the others at random boundaries.

Niah and vt samples are exactly `length` tokens; cwe and fwe fill whole words up to it. RULER's
one-shot examples (vt, cwe) are left out: they would take the small contexts a tiny run trains
at, and the answer prefix already fixes the format. A task that cannot fit at a length raises
ValueError saying so (the evaluation then reports that cell as not run).
"""

from __future__ import annotations

import dataclasses
import re
import uuid

import numpy as np

from longctx.evals import needle as needle_lib
from longctx.evals import ruler_words

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat "
                 "are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
# (RULER's prefix ends in a space; here it opens the answer, where tokenizers put it.)
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                    "variables are assigned the value {query}, they are:")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the {num_cw} "
                "most common words in the above list?")
CWE_ANSWER_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three "
                "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
                "explanation. Please ignore the dots '....'. What are the three most frequently "
                "appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# Tokens kept free for an answer of several values whose order (and so merges) is not yet known.
ANSWER_MARGIN = 8
HAYSTACKS = ("noise", "documents", "essay", "needle")
KINDS = ("niah", "vt", "cwe", "fwe")


@dataclasses.dataclass(frozen=True)
class Task:
    """One RULER task: its kind and settings (what it does not use is ignored)."""

    name: str
    kind: str  # niah | vt | cwe | fwe
    haystack: str | None = None
    key_type: str = "words"  # words | numbers | uuids
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    num_chains: int = 1
    num_hops: int = 4
    num_common: int = 10
    alpha: float = 2.0

    @property
    def uses_depth(self) -> bool:
        return self.kind in ("niah", "vt")

    @property
    def uses_documents(self) -> bool:
        return self.haystack in ("documents", "essay")


TASKS = {t.name: t for t in (
    Task("niah_single_1", "niah", "noise"),
    Task("niah_single_2", "niah", "documents"),
    Task("niah_single_3", "niah", "essay", value_type="uuids"),
    Task("niah_multikey_1", "niah", "essay", num_keys=4),
    Task("niah_multikey_2", "niah", "needle"),
    Task("niah_multikey_3", "niah", "needle", key_type="uuids", value_type="uuids"),
    Task("niah_multivalue", "niah", "essay", num_values=4),
    Task("niah_multiquery", "niah", "essay", num_keys=4, num_queries=4),
    Task("vt", "vt", "noise", num_chains=1, num_hops=4),
    Task("cwe", "cwe"),
    Task("fwe", "fwe"),
)}


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    tokens: np.ndarray  # int32 [n], natural order, one document; the answer is its last tokens
    answer_len: int
    answer_text: str  # what the answer tokens decode to
    expected: tuple[str, ...]  # the strings RULER's score looks for
    length: int  # the length asked for (tokens holds exactly this many for niah and vt)
    depth: float | None  # None for tasks without a needle (cwe, fwe)

    @property
    def answer(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.answer_len:]


def and_join(items) -> str:
    """'a', 'a and b', 'a, b, and c' (RULER's list of several keys)."""
    items = list(items)
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


class Haystacks:
    """The filler a tokenizer's samples are made of: RULER's noise, and (when given validation
    documents, as token ids of this tokenizer) the documents and their essay sentences."""

    def __init__(self, tokenizer, documents=None, limit: int = 1 << 20):
        self.tokenizer = tokenizer
        self.noise_unit = self.encode(NOISE + "\n")
        self.documents = self.sentences = None
        if documents is not None:
            self.documents = needle_lib.filler_tokens(documents, tokenizer, limit)
            text = re.sub(r"\s+", " ", tokenizer.decode(self.documents)).strip()
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
            self.sentences = [self.encode(s + " ") for s in sentences]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text.encode()), np.int32)

    def unit(self, text: str, haystack: str) -> np.ndarray:
        """A needle or statement as the haystack's units are written: a line of noise, a sentence
        of essay (or of needles), a sentence set off by spaces in documents."""
        if haystack == "noise":
            return self.encode(text + "\n")
        if haystack == "documents":
            return self.encode(" " + text + " ")
        return self.encode(text + " ")

    def filler(self, haystack: str, budget: int, rng: np.random.Generator, distractor=None):
        """(tokens [budget], boundaries): `budget` tokens of the haystack and the sorted offsets
        (0 and budget included) where a needle may go. `distractor(rng) -> text`: the needle
        haystack's needles."""
        if haystack == "documents":
            self._need_documents(haystack)
            offset = int(rng.integers(0, len(self.documents)))
            return np.take(self.documents, np.arange(offset, offset + budget), mode="wrap"), np.arange(budget + 1)
        if haystack == "noise":
            units = _cycle([self.noise_unit], 0)
        elif haystack == "essay":
            self._need_documents(haystack)
            units = _cycle(self.sentences, int(rng.integers(0, len(self.sentences))))
        elif haystack == "needle":
            units = (self.unit(distractor(rng), haystack) for _ in iter(int, 1))
        else:
            raise ValueError(f"haystack {haystack!r} is not one of {', '.join(HAYSTACKS)}.")
        parts, bounds, total = [], [0], 0
        while total < budget:
            unit = next(units)
            parts.append(unit)
            total += len(unit)
            bounds.append(min(total, budget))
        tokens = np.concatenate(parts)[:budget] if parts else np.zeros(0, np.int32)
        return tokens.astype(np.int32), np.unique(np.asarray(bounds + [budget]))

    def _need_documents(self, haystack: str) -> None:
        if self.documents is None:
            raise ValueError(f"the {haystack} haystack needs validation documents; none were given.")


def _cycle(items, start: int):
    i = start
    while True:
        yield items[i % len(items)]
        i += 1


def _insert(filler: np.ndarray, placed) -> np.ndarray:
    """`placed`: (offset, order, tokens); each unit goes at its offset, ties in `order`."""
    parts, at = [], 0
    for offset, _, tokens in sorted(placed, key=lambda p: (p[0], p[1])):
        parts += [filler[at:offset], tokens]
        at = offset
    parts.append(filler[at:])
    return np.concatenate(parts).astype(np.int32)


def _at_depth(bounds: np.ndarray, depth: float) -> int:
    return int(bounds[np.argmin(np.abs(bounds - depth * bounds[-1]))])


# ----------------------------------------------------------------------------- needle values


def _random_value(kind: str, rng: np.random.Generator) -> str:
    if kind == "numbers":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    if kind == "uuids":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    if kind == "words":
        adjective = ruler_words.ADJECTIVES[int(rng.integers(len(ruler_words.ADJECTIVES)))]
        return f"{adjective}-{ruler_words.NOUNS[int(rng.integers(len(ruler_words.NOUNS)))]}"
    raise ValueError(f"needle type {kind!r} is not one of words, numbers, uuids.")


def _distinct(kind: str, count: int, rng: np.random.Generator, avoid=()) -> list[str]:
    out = []
    while len(out) < count:
        value = _random_value(kind, rng)
        if value not in out and value not in avoid:
            out.append(value)
    return out


def _row(hay: Haystacks, head: str, tail: str, answer_text: str, context_budget) -> tuple:
    """(head, tail, answer) tokens and the tokens left for the context of a `length` row."""
    h, t, a = hay.encode(head), hay.encode(tail), hay.encode(answer_text)
    return h, t, a, context_budget - 1 - len(h) - len(t) - len(a)


def _sample(task, hay, length, depth, parts, answer, answer_text, expected) -> Sample:
    tokens = np.concatenate([[hay.tokenizer.bos_id], *parts, answer]).astype(np.int32)
    return Sample(task.name, tokens, len(answer), answer_text, tuple(expected), length, depth)


def _too_short(task: Task, length: int, need: int) -> ValueError:
    return ValueError(f"{task.name} cannot fit in {length} tokens of this tokenizer (its template, "
                      f"needles and answer take {need}).")


def niah(task: Task, hay: Haystacks, length: int, depth: float, rng: np.random.Generator) -> Sample:
    num_keys = max(task.num_keys, task.num_queries)
    keys = _distinct(task.key_type, num_keys, rng)
    values = [_distinct(task.value_type, task.num_values, rng) for _ in keys]
    asked = [int(i) for i in rng.choice(num_keys, task.num_queries, replace=False)]
    query = and_join(keys[i] for i in asked)
    kind = task.value_type
    single = task.num_queries * task.num_values == 1
    template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    if single:  # RULER's singular wording for one answer
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = prefix.replace("are", "is")
        kind = kind[:-1]
    head, tail = template.split("{context}")
    fields = dict(type_needle_v=kind, query=query)
    needles = [[hay.unit(NIAH_NEEDLE.format(type_needle_v=task.value_type, key=k, value=v), task.haystack)
                for v in vs] for k, vs in zip(keys, values)]
    # The answer: the asked keys' values in the order asked, each key's values in the order they
    # appear (the first asked needle is placed at `depth`, the rest at random boundaries).
    h = hay.encode(head.format(**fields))
    t = hay.encode(tail.format(**fields) + prefix.format(**fields))
    room = length - 1 - len(h) - len(t) - sum(len(u) for us in needles for u in us)  # filler + answer
    if task.num_values == 1:  # the answer is known before the needles are placed
        limit = room - len(hay.encode(" " + and_join(values[i][0] for i in asked) + "."))
    else:  # several values: their order, so the answer's tokens, is known after; keep room for any
        limit = room - len(hay.encode(" " + and_join(v for i in asked for v in values[i]) + ".")) - ANSWER_MARGIN
    if limit < 0:
        raise _too_short(task, length, length - limit)
    distractor = lambda r: NIAH_NEEDLE.format(  # noqa: E731
        type_needle_v=task.value_type, key=_distinct(task.key_type, 1, r, avoid=keys)[0],
        value=_random_value(task.value_type, r))
    filler, bounds = hay.filler(task.haystack, room, rng, distractor)
    bounds = bounds[bounds <= limit]
    if task.num_values == 1:
        bounds = np.unique(np.append(bounds, limit))
    placed, offsets, order = [], {}, 0
    for i, us in enumerate(needles):
        for j, unit in enumerate(us):
            offset = _at_depth(bounds, depth) if (i, j) == (asked[0], 0) else int(rng.choice(bounds))
            offsets[(i, j)] = (offset, order)
            placed.append((offset, order, unit))
            order += 1
    expected = [values[i][j] for i in asked for j in sorted(range(task.num_values), key=lambda j: offsets[(i, j)])]
    answer_text = " " + and_join(expected) + "."
    answer = hay.encode(answer_text)
    cut = room - len(answer)
    assert cut >= limit, (cut, limit)  # (ANSWER_MARGIN covers a tokenizer's merges across the values)
    context = _insert(filler[:cut], placed)
    return _sample(task, hay, length, float(depth), [h, context, t], answer, answer_text, expected)


def variable_tracking(task: Task, hay: Haystacks, length: int, depth: float,
                      rng: np.random.Generator) -> Sample:
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    names: list[str] = []
    while len(names) < task.num_chains * (task.num_hops + 1):
        name = "".join(rng.choice(letters, 5))
        if name not in names:
            names.append(name)
    chains = [names[c * (task.num_hops + 1):(c + 1) * (task.num_hops + 1)] for c in range(task.num_chains)]
    values = _distinct("numbers", task.num_chains, rng)
    values = [v[:5] for v in values]  # RULER's chains start at 5-digit values
    statements = [[f"VAR {chain[0]} = {value}"] + [f"VAR {chain[k + 1]} = VAR {chain[k]}" for k in range(task.num_hops)]
                  for chain, value in zip(chains, values)]
    units = [[hay.unit(s, task.haystack) for s in chain] for chain in statements]
    fields = dict(query=values[0], num_v=len(chains[0]))
    head, tail = VT_TEMPLATE.split("{context}")
    answer_text = " " + " ".join(chains[0])
    h, t, a, budget = _row(hay, head.format(**fields), tail.format(**fields) + VT_ANSWER_PREFIX.format(**fields),
                           answer_text, length)
    budget -= sum(len(u) for us in units for u in us)
    if budget < 0:
        raise _too_short(task, length, length - budget)
    filler, bounds = hay.filler(task.haystack, budget, rng)
    placed, order = [], 0
    for c, chain_units in enumerate(units):
        if c == 0:  # the asked chain starts at `depth`; its later statements come after it
            start = _at_depth(bounds, depth)
            later = np.sort(rng.choice(bounds[bounds >= start], len(chain_units) - 1))
            offsets = [start, *later.tolist()]
        else:
            offsets = np.sort(rng.choice(bounds, len(chain_units))).tolist()
        for offset, unit in zip(offsets, chain_units):
            placed.append((int(offset), order, unit))
            order += 1
    return _sample(task, hay, length, float(depth), [h, _insert(filler, placed), t], a, answer_text, chains[0])


def _fit_words(length: int, fixed: int, make, most: int) -> tuple[int, np.ndarray]:
    """The largest n in [0, most] whose context `make(n)` (tokens) fits in length - fixed, by
    bisection (context tokens grow with n); (-1, None) when not even n = 0 fits."""
    budget = length - fixed
    lo, hi, best = 0, most, (-1, None)
    while lo <= hi:
        mid = (lo + hi) // 2
        tokens = make(mid)
        if len(tokens) <= budget:
            best, lo = (mid, tokens), mid + 1
        else:
            hi = mid - 1
    return best


def common_words(task: Task, hay: Haystacks, length: int, rng: np.random.Generator) -> Sample:
    words = [ruler_words.SINGLE_WORDS[i] for i in rng.permutation(len(ruler_words.SINGLE_WORDS))]
    common, rare = words[:task.num_common], words[task.num_common:]
    pairs = [f"{a}-{n}" for a in ruler_words.ADJECTIVES for n in ruler_words.NOUNS]
    rare += [pairs[i] for i in rng.permutation(len(pairs))]
    seed = int(rng.integers(1 << 31))
    fields = dict(num_cw=task.num_common)
    head, tail = CWE_TEMPLATE.split("{context}")
    h, t = hay.encode(head.format(**fields)), hay.encode(tail.format(**fields) + CWE_ANSWER_PREFIX.format(**fields))
    # RULER: each common word 30 times and each rare word 3 (6 and 1 below 4K tokens); fewer
    # repeats of the common words where even they alone would not fit.
    repeats = [(30, 3)] if length >= 4096 else [(6, 1)]
    repeats += [(r, 1) for r in range(repeats[0][0] - 1, 1, -1)]
    for common_repeats, rare_repeats in repeats:
        def listing(n):
            order = np.random.default_rng(seed).permutation(task.num_common * common_repeats + n * rare_repeats)
            items = (common * common_repeats + rare[:n] * rare_repeats)
            return [items[i] for i in order]

        def make(n):
            return hay.encode(" ".join(f"{i + 1}. {w}" for i, w in enumerate(listing(n))))

        # the answer (common words in the order they first appear) has the same tokens for any n
        # up to a few: bound it by the longest numbering, checked again below
        answer_text = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
        a = hay.encode(answer_text)
        n, context = _fit_words(length, 1 + len(h) + len(t) + len(a), make, len(rare))
        if n < 0:
            continue
        first_seen = sorted(common, key=listing(n).index)
        answer_text = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(first_seen))
        a = hay.encode(answer_text)
        while 1 + len(h) + len(context) + len(t) + len(a) > length and n > 0:
            n -= 1
            context = make(n)
            first_seen = sorted(common, key=listing(n).index)
            answer_text = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(first_seen))
            a = hay.encode(answer_text)
        if 1 + len(h) + len(context) + len(t) + len(a) <= length:
            return _sample(task, hay, length, None, [h, context, t], a, answer_text, first_seen)
    raise _too_short(task, length, 1 + len(h) + len(t) + len(a) + len(make(0)))


def _zeta(alpha: float, terms: int = 1_000_000) -> float:
    k = np.arange(1, terms + 1, dtype=np.float64)
    return float(np.sum(k ** -alpha) + terms ** (1 - alpha) / (alpha - 1))


def frequent_words(task: Task, hay: Haystacks, length: int, rng: np.random.Generator) -> Sample:
    fields = {}
    head, tail = FWE_TEMPLATE.split("{context}")
    h, t = hay.encode(head.format(**fields)), hay.encode(tail.format(**fields) + FWE_ANSWER_PREFIX)
    vocab_size = max(length // 50, 8)  # RULER: one coded word per 50 tokens of context
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters, 6))
        if word not in vocab:
            vocab.append(word)
    vocab[0] = "..."  # the most frequent "word" is noise, as in RULER; the answer is ranks 2-4
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -task.alpha / _zeta(task.alpha)
    seed = int(rng.integers(1 << 31))

    def counts(n):
        return (n * weights).astype(int)

    def make(n):
        words = np.repeat(np.arange(vocab_size), counts(n))
        return hay.encode(" ".join(vocab[i] for i in np.random.default_rng(seed).permutation(words)))

    expected = vocab[1:4]
    answer_text = " " + " ".join(expected)
    a = hay.encode(answer_text)
    fixed = 1 + len(h) + len(t) + len(a)
    n, context = _fit_words(length, fixed, make, max(length, 16) * 4)
    c = counts(max(n, 0))
    if n < 0 or not c[1] > c[2] > c[3] > c[4]:
        raise ValueError(f"{task.name} cannot fit in {length} tokens of this tokenizer: its coded text "
                         f"there holds too few words for three distinct most frequent ones (counts "
                         f"{c[1:5].tolist()}).")
    return _sample(task, hay, length, None, [h, context, t], a, answer_text, expected)


def generate(task: Task, hay: Haystacks, length: int, depth: float | None, rng: np.random.Generator) -> Sample:
    """One sample of `task` of `length` tokens (depth ignored by cwe and fwe)."""
    if task.kind == "niah":
        return niah(task, hay, length, depth, rng)
    if task.kind == "vt":
        return variable_tracking(task, hay, length, depth, rng)
    if task.kind == "cwe":
        return common_words(task, hay, length, rng)
    if task.kind == "fwe":
        return frequent_words(task, hay, length, rng)
    raise ValueError(f"task kind {task.kind!r} is not one of {', '.join(KINDS)}.")
