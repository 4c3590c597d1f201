"""Data mixtures (data.sources, longctx/data/mixture.py): token shares, exact resume, a weight change
or an added source on resume, each data shard reading its shard of every source, length filters and
upsampling.

Every source is written here with ids no other source holds (source k's target ids lie in its own
range, each id once), so a row's source, and whether a source continued where it was, can be read
off its targets.
"""

import json

import jax
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.data import mixture, prepare, sharding
from longctx.errors import ConfigError
from longctx.parallel import mesh as mesh_lib
from longctx.train import checkpoint_compat as compat

SEQ = 128
PAD, BOS = 1, 2
SPAN = 1_000_000  # ids of source k: [k * SPAN, (k + 1) * SPAN)
# (name, documents, shortest, longest): short, middling and long documents, so a row holds ~8,
# ~2 or a piece of one document, and a weight on documents would be far from one on tokens.
SOURCES = [("a", 200, 2, 30), ("b", 100, 20, 100), ("c", 60, 100, 600)]
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def _write_source(directory, k: int, num_documents: int, shortest: int, longest: int) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(k)
    lengths = rng.integers(shortest, longest + 1, num_documents)
    writer = ArrayRecordWriter(str(directory / "train-00000.array_record"), "group_size:1")
    next_id = k * SPAN + 3
    for n in lengths:
        doc = np.concatenate([[BOS], np.arange(next_id, next_id + n - 1)]).astype("<i4")
        writer.write(doc.tobytes())
        next_id += int(n) - 1
    writer.close()
    counts = {"num_documents": len(lengths), "num_tokens": int(lengths.sum())}
    meta = {"tokenizer": "unique-ids (a test's)", "vocab_size": 5 * SPAN, "bos_id": BOS,
            "eos_id": BOS, "pad_id": PAD,
            "splits": {"train": {"files": [{"path": "train-00000.array_record", **counts}], **counts},
                       "validation": {"files": [], "num_documents": 0, "num_tokens": 0}}}
    (directory / prepare.METADATA).write_text(json.dumps(meta))
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for k, (name, n, lo, hi) in enumerate(SOURCES + [("d", 100, 20, 200)]):
        (root / name).mkdir()
        out[name] = _write_source(root / name, k, n, lo, hi)
    return out


def _config(dirs, weights=WEIGHTS, prefetch=0, **extra):
    c = base.get_config("tiny")
    c.data.update(seq_len=SEQ, global_batch_size=1, packer="best_fit", num_workers=0,
                  prefetch_buffer_size=prefetch)
    c.mesh.update(dp=1, fsdp=1, sp=1)
    c.model.vocab_size = 5 * SPAN
    c.train.loss_chunk_size = SEQ
    with c.unlocked():
        c.data.sources = {n: {"path": dirs[n], "weight": w, **extra.get(n, {})} for n, w in weights.items()}
    return c


def _iterator(config):
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:1])
    return mixture.make_batch_iterator(config, mesh, layout="contiguous", data_dir="")


def _source_of(row) -> str:
    ids = row["targets"][row["loss_mask"] > 0]
    (k,) = set((ids // SPAN).tolist())  # one source per row
    return "abcd"[k]


def _take(iterator, n):
    return [{k: v[0] for k, v in iterator.next_local().items()} for _ in range(n)]


def _by_source(rows) -> dict[str, list]:
    out = {}
    for row in rows:
        out.setdefault(_source_of(row), []).append(row)
    return out


def test_token_shares_within_a_point_of_the_weights_over_200_rows(dirs):
    config = _config(dirs)
    config_lib.validate(config, 1)
    it = _iterator(config)
    rows = _take(it, 200)
    it.close()
    tokens = {n: 0 for n in WEIGHTS}
    for row in rows:
        tokens[_source_of(row)] += int(row["loss_mask"].sum())
    total = sum(tokens.values())
    shares = {n: t / total for n, t in tokens.items()}
    for name, weight in WEIGHTS.items():
        assert abs(shares[name] - weight) < 0.01, (shares, WEIGHTS)
    # What the start-up line reports is the same measurement.
    reported = mixture.achieved_shares(config, rows=200)
    assert {n: round(s, 6) for n, s in shares.items()} == {n: r["share"] for n, r in reported.items()}
    line = mixture.describe_shares(reported)
    assert line.startswith("data mixture by tokens over the first 200 rows: a ") and "(weight 50.0%)" in line


def test_exact_resume_of_a_mixture(dirs):
    config = _config(dirs, prefetch=2)
    it = _iterator(config)
    _take(it, 23)
    state = json.loads(json.dumps(it.get_state()))  # as Orbax writes it
    after = _take(it, 40)
    it.close()
    resumed = _iterator(config)
    _take(resumed, 3)  # (a fresh iterator that has already moved: set_state must not care)
    resumed.set_state(state)
    again = _take(resumed, 40)
    resumed.close()
    for x, y in zip(after, again):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    assert len(_by_source(after)) == 3


def test_a_weight_change_and_an_added_source_continue_every_source_where_it_was(dirs):
    before = _config(dirs)
    it = _iterator(before)
    _take(it, 30)
    state = json.loads(json.dumps(it.get_state()))
    record = it.stream_record()
    continued = _by_source(_take(it, 300))  # each source's own continuation
    it.close()

    weights = {"a": 0.2, "b": 0.3, "c": 0.3, "d": 0.2}
    after = _config(dirs, weights)
    fresh_it = _iterator(after)
    fresh_d = _by_source(_take(fresh_it, 60))["d"]
    fresh_it.close()
    resumed = _iterator(after)
    # The checkpoint's checks: no restart of the stream, and the one line of what changed.
    assert compat.data_state_mismatch(after.to_dict(), {"process_count": 1, compat.DATA_STREAM: record},
                                      after.to_dict(), resumed.stream_record(), 1) is None
    notice = compat.mixture_notice({compat.DATA_STREAM: record}, resumed.stream_record())
    assert notice == ("the data mixture changed: weights a 0.5 -> 0.2, c 0.2 -> 0.3; added d (from its "
                      "beginning); a, b, c continue where they were; the mixer counts tokens afresh at "
                      "the new weights"), notice
    resumed.set_state(state)
    got = _by_source(_take(resumed, 60))
    resumed.close()
    assert set(got) == {"a", "b", "c", "d"}
    for name in "abc":
        for x, y in zip(got[name], continued[name], strict=False):
            np.testing.assert_array_equal(x["targets"], y["targets"])
    for x, y in zip(got["d"], fresh_d, strict=False):
        np.testing.assert_array_equal(x["targets"], y["targets"])
    # The new shares hold from the resume on (the counts start afresh).
    tokens = {n: sum(int(r["loss_mask"].sum()) for r in rows) for n, rows in got.items()}
    assert abs(tokens["a"] / sum(tokens.values()) - 0.2) < 0.03


def test_a_changed_source_restarts_alone_and_says_why(dirs):
    it = _iterator(_config(dirs))
    _take(it, 20)
    state, record = json.loads(json.dumps(it.get_state())), it.stream_record()
    it.close()
    changed = _config(dirs, b={"max_length": 40})
    resumed = _iterator(changed)
    notice = compat.mixture_notice({compat.DATA_STREAM: record}, resumed.stream_record())
    assert notice == ("the data mixture changed: b restarts from its beginning (num_packing_bins: 47 "
                      "then vs 5 now; max_length: 0 then vs 40 now); a, c continue where they were; the "
                      "mixer counts tokens afresh at the new weights"), notice
    resumed.set_state(state)
    assert resumed.get_state()["sources"]["b"]["state"] == iter(
        mixture.source_rows(changed, mixture.sources(changed)[1], dirs["b"],
                            shard=sharding.DataShard(0, 1, 0, 1), sp=1).rows).get_state()
    resumed.close()


def test_each_data_shard_reads_its_own_documents_of_every_source(dirs):
    config = _config(dirs)
    seen = []
    for index in range(2):
        rows, _ = mixture.mixture_rows(config, dirs, shard=sharding.DataShard(index, 2, index, index + 1), sp=1)
        it = iter(rows)
        # (6 rows: within each source's first epoch, after which the shards' documents change hands)
        targets = np.concatenate([r["targets"][r["loss_mask"] > 0] for r in (next(it) for _ in range(6))])
        seen.append(set(targets.tolist()))
        assert {int(t) // SPAN for t in targets} == {0, 1, 2}
    assert not seen[0] & seen[1]


def test_a_mixture_and_one_path_do_not_share_a_stream(dirs):
    it = _iterator(_config(dirs))
    record = it.stream_record()
    it.close()
    one = dict(record, sources=None)
    del one["sources"]
    why = compat.data_state_mismatch({}, {"process_count": 1, compat.DATA_STREAM: record}, {}, one, 1)
    assert why == "was saved from a mixture (data.sources) and this run reads one data.path"


def test_length_filters_and_upsampling_select_documents():
    lengths = np.array([5, 50, 500, 5000, 40, 700])
    source = mixture.Source("x", "p", 1.0, min_length=10, max_length=1000, upsample_factor=2.5,
                            upsample_above=500)
    picked = mixture.selected_documents(source, lengths)
    counts = np.bincount(picked, minlength=len(lengths))
    assert counts[0] == 0 and counts[3] == 0  # too short, too long
    assert counts[1] == counts[4] == 1
    assert set(counts[[2, 5]].tolist()) <= {2, 3}
    many = mixture.selected_documents(mixture.Source("y", "p", 1.0, upsample_factor=2.5, upsample_above=100),
                                      np.full(4000, 200))
    assert abs(len(many) / 4000 - 2.5) < 0.05
    with pytest.raises(ConfigError, match="data.sources.x: no train document has 10 to 20 tokens"):
        mixture.selected_documents(mixture.Source("x", "p", 1.0, min_length=10, max_length=20), lengths)


@pytest.mark.parametrize("source, message", [
    ({"path": "x", "weight": 0}, "data.sources.s.weight=0 must be positive"),
    ({"path": "", "weight": 1.0}, "data.sources.s.path='' must name a prepared directory"),
    ({"path": "x", "wieght": 1.0}, "data.sources.s has unknown key(s) wieght"),
    ({"path": "x", "upsample_factor": 3.0}, "upsample_factor=3.0 needs upsample_above"),
    ({"path": "x", "min_length": 10, "max_length": 5}, "max_length=5 is below its min_length=10"),
    ({"path": "embedded:pkgs"}, "data.sources.s.path=embedded:pkgs names no embedded source: the embedded "
                                "sources are embedded:files (the Python standard library, one file per document) "
                                "and embedded:packages (one top-level package per document)."),
])
def test_bad_sources_are_one_sentence(source, message):
    c = base.get_config("tiny")
    with c.unlocked():
        c.data.sources = {"s": source}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_lib.validate(c, 8)


def test_stdlib_packages_are_one_document_each_in_a_fixed_order(tmp_path):
    root = tmp_path / "lib"
    for path, text in {"email/__init__.py": "A", "email/mime/text.py": "C", "email/base.py": "B",
                       "email/test/test_x.py": "no", "json/__init__.py": "J", "single.py": "module",
                       "notapackage/x.py": "no __init__"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    docs = prepare.stdlib_packages(str(root))
    assert docs == {"email": b"# email/__init__.py\nA\n# email/base.py\nB\n# email/mime/text.py\nC",
                    "json": b"# json/__init__.py\nJ"}


def test_the_long_mix_preset_is_prolongs_shape():
    c = base.get_config("long_mix_cpu")
    config_lib.validate(c, 8)
    got = {s.name: (s.path, s.weight) for s in mixture.sources(c)}
    assert got == {"files": (mixture.EMBEDDED_FILES, 0.4), "packages": (mixture.EMBEDDED_PACKAGES, 0.6)}
