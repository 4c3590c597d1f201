"""`--validate_only` checks every source of data.sources (mixture.check_sources, through
train.check_inputs) before anything is prepared or compiled: each bad source is one sentence that
names it and says what to do, and nothing is written."""

import json
import os
import shutil
import sys

import pytest

from configs import base
from longctx import config as config_lib
from longctx.data import prepare
from longctx.errors import ConfigError
from longctx.train import loop
from tests import ROOT, child_env
from tests.data.mixture_sources import WEIGHTS, prepare_sources, sources_override
from tests.synthetic import make_corpus
from tests.validate_commands import ScriptServer

TRAIN = os.path.join(ROOT, "scripts", "train.py")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return prepare_sources(tmp_path_factory.mktemp("validate_sources"))


def _config(sources: dict, **data):
    c = base.get_config("tiny")
    c.data.update(**data)
    with c.unlocked():
        c.data.sources = sources
    return c


def _check(config, workdir) -> str:
    return loop.check_inputs(config, str(workdir), config_lib.validate(config, 8))


def _mixture(dirs, **changed):
    """The three sources, with some replaced: `name=dict(path=..., ...)`."""
    return {n: changed.get(n) or {"path": d, "weight": WEIGHTS[n]} for n, d in dirs.items()}


def test_every_source_checked_and_nothing_written(dirs, tmp_path):
    assert _check(_config(_mixture(dirs)), tmp_path / "w") == (
        f"config, mesh dp=1 x fsdp=2 x sp=4, workdir {tmp_path / 'w'} and data sources books, code, web are fine")
    assert not (tmp_path / "w").exists()
    # An embedded source not prepared yet is left to its first use (validate_only prepares nothing).
    cache = tmp_path / "cache"
    cache.mkdir()
    words = _check(_config(_mixture(dirs, web={"path": "embedded:files"}), cache_dir=str(cache)), tmp_path / "w")
    assert words.endswith("data sources books, code, web (embedded, prepared on first use) are fine"), words
    assert os.listdir(cache) == []


def _copy(dirs, tmp_path, name="code") -> str:
    copy = str(tmp_path / f"{name}_copy")
    shutil.copytree(dirs[name], copy)
    return copy


def _edit_metadata(directory: str, **changes) -> None:
    path = os.path.join(directory, prepare.METADATA)
    meta = json.load(open(path))
    meta.update(changes)
    json.dump(meta, open(path, "w"))


def _truncate_a_shard(directory: str) -> str:
    shard = os.path.join(directory, json.load(open(os.path.join(directory, prepare.METADATA)))
                         ["splits"]["train"]["files"][0]["path"])
    os.truncate(shard, os.path.getsize(shard) // 2)
    return shard


@pytest.mark.parametrize("case", ["missing", "file", "not_prepared", "other_files", "tokenizer", "corrupt",
                                  "filters", "no_validation", "vocab"])
def test_each_bad_source_is_one_sentence_naming_it(dirs, tmp_path, case):
    code = {"path": _copy(dirs, tmp_path), "weight": 0.3}
    extra = {}
    if case == "missing":
        code["path"] = str(tmp_path / "nowhere")
        want = (f"data.sources.code.path={code['path']} does not exist: prepare it with scripts/prepare_data.py "
                f"--output {code['path']} (docs/data.md, \"Mixtures\").")
    elif case == "file":
        code["path"] = os.path.join(code["path"], prepare.METADATA)
        want = (f"data.sources.code.path={code['path']} is a file, not a directory: point it at the directory "
                "scripts/prepare_data.py wrote (its --output).")
    elif case == "not_prepared":
        code["path"] = str(tmp_path / "empty")
        os.mkdir(code["path"])
        want = (f"data.sources.code.path={code['path']} holds no metadata.json, so it is not a prepared "
                f"dataset: prepare it with scripts/prepare_data.py --output {code['path']} (docs/data.md, "
                "\"Mixtures\").")
    elif case == "other_files":  # (docs/: writing a dataset into it is no fix)
        code["path"] = str(tmp_path / "docs")
        os.mkdir(code["path"])
        open(os.path.join(code["path"], "guide.md"), "w").close()
        want = (f"data.sources.code.path={code['path']} holds no metadata.json, so it is not a prepared "
                "dataset: point it at a directory scripts/prepare_data.py wrote (its --output), or prepare one "
                "into a new directory (docs/data.md, \"Mixtures\").")
    elif case == "tokenizer":
        _edit_metadata(code["path"], tokenizer="sentencepiece:other.model")
        want = (f"data.sources.code ({code['path']}) has tokenizer='sentencepiece:other.model' and "
                "data.sources.books has 'byte': every source of a mixture must be prepared with the same "
                "tokenizer, so prepare code again with --tokenizer byte.")
    elif case == "corrupt":
        shard = _truncate_a_shard(code["path"])
        want = f"data.sources.code: {shard} is corrupt: "
    elif case == "filters":
        code["max_length"] = 1
        want = "data.sources.code: no train document has 0 to 1 tokens (they have "
    elif case == "no_validation":
        code["path"] = str(tmp_path / "no_val")
        prepare.prepare([str(make_corpus(tmp_path, num_docs=10))], code["path"], val_fraction=0, progress=False)
        want = (f"data.sources.code: {code['path']} has no validation documents, and train.eval_every=100 "
                "evaluates on them: set --config.train.eval_every=0, or prepare the data again with "
                "--val-fraction above 0 from more documents.")
    else:
        extra = {"vocab_size": 100}
        want = ("model.vocab_size=100 is smaller than the dataset's tokenizer vocabulary (259 in "
                f"{dirs['books']}/metadata.json): set --config.model.vocab_size=259.")
    config = _config(_mixture(dirs, code=code))
    config.model.update(**extra)
    with pytest.raises(ConfigError) as e:
        _check(config, tmp_path / "w")
    message = str(e.value)
    assert message == want if want.endswith(".") else message.startswith(want), message
    assert "\n" not in message
    assert not (tmp_path / "w").exists()


def _train(*flags):
    return ScriptServer.run([sys.executable, TRAIN, "--config=configs/base.py:tiny", *flags, "--validate_only"],
                            cwd=ROOT, env=child_env.script_env(), timeout=300)


@pytest.mark.slow
def test_train_validate_only_refuses_a_bad_source_before_compiling(dirs, tmp_path):
    bad = dict(dirs, web=str(tmp_path / "web_not_made"))
    r = _train(f"--workdir={tmp_path / 'w'}", sources_override(bad))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (f"longctx: data.sources.web.path={bad['web']} does not exist: prepare it with "
                                f"scripts/prepare_data.py --output {bad['web']} (docs/data.md, \"Mixtures\").")
    assert r.stdout == "" and not (tmp_path / "w").exists()
