"""prepare_data.py --tokenizer hf:...: a Hugging Face tokenizer.json through the `tokenizers` library.

The tokenizer is built here: a byte-level BPE of 400 ids trained with `tokenizers` on the
embedded corpus (standard-library sources, here the `json` package), with <s> and </s> as BOS
and EOS in tokenizer_config.json, the way Hugging Face model directories name them.
"""

import hashlib
import json
import os
import sys

import pytest

from longctx.data import load_metadata
from longctx.data.pipeline import TokenSource
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import ConfigError
from tests import ROOT as REPO
from tests.validate_commands import ScriptServer

CORPUS = os.path.dirname(json.__file__)  # a few standard-library files of the embedded corpus
VOCAB = 400


def corpus_texts():
    return [open(os.path.join(CORPUS, f), encoding="utf-8").read()
            for f in sorted(os.listdir(CORPUS)) if f.endswith(".py")]


def build_tokenizer(directory, *, config: dict | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()  # byte-level: decode(encode(text)) == text
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
    return tok


def prepare(*args):
    return ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), "--quiet",
                             *map(str, args)], timeout=300, cwd=REPO)


def test_prepare_data_with_an_hf_tokenizer(tmp_path):
    source = tmp_path / "model"
    hf_tok = build_tokenizer(source, config={"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                             "chat_template": "unused"})
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        r = prepare("--input", CORPUS, "--glob", "*.py", "--output", out, "--tokenizer", f"hf:{source}",
                    "--val-fraction", "0.3")
        assert r.returncode == 0, r.stderr
        assert "tokenizer hf:tokenizer.json, vocab 400" in r.stdout
    meta = load_metadata(str(outs[0]))
    assert meta["tokenizer"] == "hf:tokenizer.json" and meta["vocab_size"] == VOCAB
    assert (meta["bos_id"], meta["eos_id"]) == (hf_tok.token_to_id("<s>"), hf_tok.token_to_id("</s>"))
    assert meta["pad_id"] == meta["eos_id"]  # no pad_token: EOS stands in (padding is masked)
    # Self-contained: the copy in the dataset is what the pipeline loads, with the same ids.
    assert sorted(f for f in os.listdir(outs[0]) if f.startswith("tokenizer")) == \
        ["tokenizer.json", "tokenizer_config.json"]
    tok = load_tokenizer(meta["tokenizer"], str(outs[0]))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (VOCAB, meta["bos_id"], meta["eos_id"])
    docs = [x for split in ("train", "validation") for x in TokenSource(str(outs[0]), split, meta)]
    assert all(x[0] == meta["bos_id"] and x[-1] == meta["eos_id"] for x in docs)
    assert all(meta["bos_id"] not in x[1:-1] and meta["eos_id"] not in x[1:-1] for x in docs)
    assert sorted(tok.decode(x) for x in docs) == sorted(corpus_texts())  # lossless
    assert sum(len(x) for x in docs) < sum(len(t.encode()) for t in corpus_texts()) / 2  # BPE merges
    # Re-running writes the same bytes.
    digests = [{f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in sorted(os.listdir(d))}
               for d in outs]
    assert digests[0] == digests[1]


def test_tokenizer_json_file_with_ids_from_config_json(tmp_path):
    """A tokenizer.json path (not a directory) whose BOS/EOS come from the model's config.json."""
    hf_tok = build_tokenizer(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"bos_token_id": hf_tok.token_to_id("<s>"), "eos_token_id": [hf_tok.token_to_id("</s>"), 0]}, f)
    tok = load_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    assert (tok.bos_id, tok.eos_id) == (hf_tok.token_to_id("<s>"), hf_tok.token_to_id("</s>"))
    ids = tok.encode_document("def f():\n    return 'é'\n".encode())
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == "def f():\n    return 'é'\n"


def test_bad_hf_tokenizers_are_named(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json does not exist"):
        load_tokenizer(f"hf:{tmp_path}")
    build_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="names no BOS or EOS token"):
        load_tokenizer(f"hf:{tmp_path}")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "</s>"}, f)
    with pytest.raises(ConfigError, match=r"bos_token '<\|begin_of_text\|>' is not in the vocabulary"):
        load_tokenizer(f"hf:{tmp_path}")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not a readable Hugging Face tokenizer"):
        load_tokenizer(f"hf:{tmp_path}")


@pytest.mark.slow
def test_vocabulary_check_against_the_model_still_applies(tmp_path):
    source = tmp_path / "model"
    build_tokenizer(source, config={"bos_token": "<s>", "eos_token": "</s>"})
    data = tmp_path / "data"
    assert prepare("--input", CORPUS, "--glob", "*.py", "--output", data, "--tokenizer", f"hf:{source}",
                   "--val-fraction", "0.3").returncode == 0
    r = ScriptServer.run([sys.executable, os.path.join(REPO, "scripts", "train.py"), "--config=configs/base.py:tiny",
                          f"--workdir={tmp_path / 'run'}", f"--config.data.path={data}", "--config.model.vocab_size=256"],
                         timeout=300, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("longctx: model.vocab_size=256 is smaller than")
    assert "400" in r.stderr
