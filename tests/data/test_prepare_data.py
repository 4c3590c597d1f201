"""scripts/prepare_data.py on small generated corpora: text + jsonl, byte + SentencePiece."""

import errno
import hashlib
import io
import json
import os
import random
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from longctx.data import load_metadata, packed_rows
from longctx.data import prepare as prepare_lib
from longctx.data.pipeline import TokenSource
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import ConfigError
from tests import ROOT
from tests.validate_commands import ScriptServer

SCRIPT = os.path.join(ROOT, "scripts", "prepare_data.py")
WORDS = "the of and to in is was for on that with as by at from long context ring attention".split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + ".\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of .txt files (one nested) and a .jsonl file, with one empty document each."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "txt" / "sub").mkdir(parents=True)
    for i in range(12):
        (root / "txt" / ("sub" if i % 3 == 0 else "") / f"doc{i:02d}.txt").write_text(
            sentence(rng, rng.randint(5, 300)))
    (root / "txt" / "empty.txt").write_text("")
    (root / "txt" / "skip.md").write_text("not matched by the glob")
    lines = [json.dumps({"text": sentence(rng, rng.randint(3, 200)), "id": i}) for i in range(40)]
    lines.insert(5, json.dumps({"text": ""}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n\n")
    return root


def run(*args):
    return ScriptServer.run([sys.executable, SCRIPT, "--quiet", *map(str, args)],
                            timeout=300)


def digest(d):
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in sorted(os.listdir(d))}


def check_dataset(d, num_docs, texts=None):
    meta = load_metadata(str(d))
    assert meta["num_documents"] == num_docs
    assert meta["splits"]["validation"]["num_documents"] >= 1
    tok = load_tokenizer(meta["tokenizer"], str(d))
    assert tok.vocab_size == meta["vocab_size"]
    docs = [x for s in ("train", "validation") for x in TokenSource(str(d), s, meta)]
    assert sum(len(x) for x in docs) == meta["num_tokens"]
    assert all(x[0] == meta["bos_id"] and x[-1] == meta["eos_id"] for x in docs)
    assert max(int(x.max()) for x in docs) < meta["vocab_size"]
    if texts is not None:  # lossless round trip
        assert sorted(tok.decode(x) for x in docs) == sorted(texts)
    # The pipeline packs it.
    row = next(iter(packed_rows(str(d), "train", seq_len=128, packer="best_fit", seed=0)))
    assert row["loss_mask"].sum() > 0
    return meta


def texts_of(corpus):
    txt = [p.read_text() for p in sorted((corpus / "txt").rglob("*.txt")) if p.stat().st_size]
    js = [json.loads(l)["text"] for l in (corpus / "docs.jsonl").read_text().splitlines() if l]
    return txt + [t for t in js if t]


def test_byte_text_and_jsonl_byte_identical_reruns(corpus, tmp_path):
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    for out in (out_a, out_b):
        r = run("--input", corpus / "txt", corpus / "docs.jsonl", "--glob", "*.txt",
                "--output", out, "--val-fraction", "0.1")
        assert r.returncode == 0, r.stderr
    assert "52 documents" in r.stdout
    meta = check_dataset(out_a, 52, texts_of(corpus))
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 259
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (256, 257, 258)
    assert digest(out_a) == digest(out_b)
    # Re-running into an existing output replaces it with the same bytes (given --overwrite).
    assert run("--input", corpus / "txt", corpus / "docs.jsonl", "--glob", "*.txt",
               "--output", out_a, "--val-fraction", "0.1", "--overwrite").returncode == 0
    assert digest(out_a) == digest(out_b)


def test_train_then_use_sentencepiece(corpus, tmp_path):
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    for out in (out_a, out_b):
        r = run("--input", corpus / "docs.jsonl", "--output", out, "--train-sentencepiece", 300)
        assert r.returncode == 0, r.stderr
    assert digest(out_a) == digest(out_b)
    meta = check_dataset(out_a, 40, [t for t in texts_of(corpus)[12:]])
    assert meta["tokenizer"] == "sentencepiece:tokenizer.model" and meta["vocab_size"] == 300
    # The trained model is then usable as --tokenizer for another corpus (text files).
    out_c = tmp_path / "c"
    r = run("--input", corpus / "txt", "--glob", "*.txt", "--output", out_c,
            "--tokenizer", f"sentencepiece:{out_a / 'tokenizer.model'}")
    assert r.returncode == 0, r.stderr
    check_dataset(out_c, 12, texts_of(corpus)[:12])
    assert (out_c / "tokenizer.model").read_bytes() == (out_a / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("args,message", [
    (["--input", "{root}/missing.txt"], "missing.txt does not exist"),
    (["--input", "{root}/txt/empty.txt"], "no documents found"),
    (["--input", "{root}/txt", "--glob", "*.rst"], "has no files matching --glob"),
    (["--input", "{root}/docs.jsonl", "--text-field", "body"], "docs.jsonl:1 has no field 'body'"),
    (["--input", "{root}/docs.jsonl", "--tokenizer", "sentencepiece:{root}/none.model"],
     "none.model does not exist"),
])
def test_bad_input_is_one_clear_sentence(corpus, tmp_path, args, message):
    r = run(*[a.format(root=corpus) for a in args], "--output", tmp_path / "out")
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    ids = tok.encode_document("naïve — ok".encode())
    assert ids[0] == 256 and ids[-1] == 257 and ids.dtype == np.int32
    assert tok.decode(ids) == "naïve — ok"


def test_blank_documents_are_dropped_and_counted(tmp_path):
    """Whitespace-only documents go where empty ones go: dropped, and counted."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("a real document\n")
    (tmp_path / "in" / "b.txt").write_text("")
    (tmp_path / "in" / "c.txt").write_text(" \n\t \u3000\n")  # (U+3000: an ideographic space)
    (tmp_path / "in" / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in
                                                       ["one", "", "  \n ", "two"]) + "\n")
    r = run("--input", tmp_path / "in", "--output", tmp_path / "out", "--val-fraction", "0.1")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "prepare_data: dropped 4 empty or whitespace-only document(s), e.g. b.txt.\n"
    meta = load_metadata(str(tmp_path / "out"))
    tok = load_tokenizer(meta["tokenizer"], str(tmp_path / "out"))
    docs = [tok.decode(x) for s in ("train", "validation")
            for x in TokenSource(str(tmp_path / "out"), s, meta)]
    assert sorted(docs) == ["a real document\n", "one", "two"]
    assert (meta["num_empty_documents"], meta["empty_document_example"]) == (4, "b.txt")


def test_own_output_is_never_read_as_input(tmp_path):
    """--output inside the input directory: a second run (--overwrite) leaves the first run's
    dataset out of its inputs, and writes the same bytes; a dataset given as input is refused."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(sentence(rng, 40))
    out = corpus / "prepared"
    assert run("--input", corpus, "--output", out, "--val-fraction", "0.3").returncode == 0
    first = digest(out)
    r = run("--input", corpus, "--output", out, "--val-fraction", "0.3", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert digest(out) == first
    assert load_metadata(str(out))["num_documents"] == 6
    for inp, message in [(out, f"input {out} is a prepared longctx dataset, not text to prepare"),
                         (out / "metadata.json", f"input {out / 'metadata.json'} is a file of {out}, "
                                                 "which is a prepared longctx dataset")]:
        r = run("--input", inp, "--output", tmp_path / "other")
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("val_fraction,why", [
    ("0", "--val-fraction is 0"), ("0.01", "1 document(s) cannot fill two splits")])
def test_no_validation_documents_warned_at_prepare_refused_at_start(tmp_path, monkeypatch,
                                                                    val_fraction, why):
    """One big file (one document), or --val-fraction 0: prepare_data warns; a run that evaluates
    refuses the dataset at start-up, before it compiles or trains anything; one that does not
    evaluate accepts it."""
    from configs import base
    from longctx import data as data_lib
    from longctx import errors
    from longctx.parallel import mesh as mesh_lib
    from longctx.train import loop as train_lib

    (tmp_path / "book.txt").write_text(sentence(random.Random(2), 3000))
    out = tmp_path / "data"
    r = run("--input", tmp_path / "book.txt", "--output", out, "--val-fraction", val_fraction)
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"prepare_data: WARNING: the validation split is empty ({why}), so training "
                        "with evaluation (train.eval_every > 0) refuses this dataset; prepare it "
                        "again with --val-fraction above 0 from more documents, or train with "
                        "--config.train.eval_every=0.\n")

    def compiles(*args, **kwargs):
        raise AssertionError("the run got as far as building its train state")

    monkeypatch.setattr(train_lib, "make_setup", compiles)
    config = base.get_config("tiny")
    config.data.path, config.train.eval_every = str(out), 50
    with pytest.raises(errors.ConfigError) as e:
        train_lib.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(e.value) == (f"{out} has no validation documents, and train.eval_every=50 evaluates "
                            "on them: set --config.train.eval_every=0, or prepare the data again "
                            "with --val-fraction above 0 from more documents.")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    config.train.eval_every = 0
    data_lib.check_splits(config, load_metadata(str(out)), str(out), mesh_lib.make_mesh(config.mesh))


def test_an_output_that_cannot_be_made_names_it_and_the_reason(corpus, tmp_path, monkeypatch):
    """It said "unexpected OSError", named its temporary directory and exited 1. A file in the way
    fails for root too (permission bits do not stop root); a read-only file system is simulated
    where the temporary directory is made (EROFS is what mkdtemp met there)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    out = blocker / "data" / "out"
    r = run("--input", corpus / "txt", "--output", out)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"longctx: --output {out} cannot be written ({blocker} is a file, not a "
                        "directory); choose another --output.\n")

    def read_only(prefix, dir):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, prefix + "abc123"))

    monkeypatch.setattr(prepare_lib.tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError) as e:
        prepare_lib.prepare([str(corpus / "txt")], str(tmp_path / "out"), progress=False)
    assert str(e.value) == (f"--output {tmp_path / 'out'} cannot be written (Read-only file system "
                            "(errno 30)); choose another --output.")


def _file_size_limit():
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # a full disk, for root too
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing


def test_a_write_that_fails_midway_names_the_output_not_its_temporary_copy(corpus, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, SCRIPT, "--quiet", "--input", corpus / "txt", "--output",
                        out], capture_output=True, text=True, timeout=300,
                       preexec_fn=_file_size_limit)
    assert r.returncode == 1, r.stderr
    assert r.stderr == (f"longctx: prepare_data could not write --output {out} (write() failed: "
                        f"File too large); {out} is as it was: free space there or choose another "
                        "--output.\n")
    assert os.listdir(tmp_path) == []  # the temporary copy is gone


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log(corpus, tmp_path, monkeypatch,
                                                                  capsys):
    """The bar's redraws (carriage returns) piled up in redirected logs."""
    r = ScriptServer.run([sys.executable, SCRIPT, "--input", corpus / "txt", "--output",
                          tmp_path / "piped"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "%|" not in r.stderr, r.stderr

    clock = iter(range(0, 10_000, 10))  # 10 s a file: a line every 3 files at LOG_EVERY_S=30
    monkeypatch.setattr(prepare_lib.time, "monotonic", lambda: float(next(clock)))
    files = len(prepare_lib.list_sources([str(corpus / "txt")]))
    prepare_lib.prepare([str(corpus / "txt")], str(tmp_path / "log"), progress=True,
                        val_fraction=0)  # one pass over the files
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" files,")[0] for line in lines] == [
        f"prepare: {n} of {files}" for n in range(3, files + 1, 3)]
    assert lines[0].endswith(" tokens, 30 s") and lines[1].endswith(" tokens, 60 s")

    monkeypatch.setattr(sys, "stderr", _Terminal())
    prepare_lib.prepare([str(corpus / "txt")], str(tmp_path / "tty"), progress=True)
    assert "prepare: 100%|" in sys.stderr.getvalue()
