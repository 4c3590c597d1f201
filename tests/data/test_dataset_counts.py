"""metadata.json against its shards at start-up: every count it states is what the files' chunk
headers hold (shard_counts), and data.path naming a file says so."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from configs import base
from longctx.data import resolve_dataset, shard_counts
from longctx.errors import ConfigError
from tests import ROOT
from tests.validate_commands import ScriptServer


def config_at(path):
    c = base.get_config("tiny")
    c.data.path = str(path)
    return c


def edited_copy(data_dir, tmp_path, edit):
    d = tmp_path / "copy"
    shutil.copytree(data_dir, d)
    meta = json.loads((d / "metadata.json").read_text())
    edit(meta)
    (d / "metadata.json").write_text(json.dumps(meta))
    return d


def write_shard(path, docs, group_size=1):
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(path), f"group_size:{group_size}")
    for ids in docs:
        w.write(np.asarray(ids, "<i4").tobytes())
    w.close()


def test_a_dataset_as_prepared_passes(data_dir):
    assert resolve_dataset(config_at(data_dir)) == data_dir


def test_counts_are_the_records_whatever_their_sizes_and_block_boundaries(tmp_path):
    """Chunk headers cut by block headers at every 64 KiB, documents longer than a block, and
    the padding Riegeli puts after chunks: the counts are what reading every record gives."""
    rng = np.random.default_rng(0)
    sizes = [2, 3] + [int(n) for n in rng.integers(2, 3000, 400)] + [40_000, 17, 70_000, 5]
    docs = [rng.integers(0, 50_000, n) for n in sizes]
    path = tmp_path / "s.array_record"
    write_shard(path, docs)
    assert os.path.getsize(path) > 8 * shard_counts.BLOCK_SIZE
    assert shard_counts.shard_counts(str(path), len(docs)) == shard_counts.ShardCounts(
        len(docs), sum(sizes), max(sizes))
    # A record count the headers do not reach (an index of another file) is not a count.
    assert shard_counts.shard_counts(str(path), len(docs) + 1) is None


def test_several_records_per_chunk_count_but_have_no_longest(tmp_path):
    docs = [np.arange(n) for n in (5, 9, 2, 30, 4, 7, 3)]
    path = tmp_path / "g.array_record"
    write_shard(path, docs, group_size=3)
    assert shard_counts.shard_counts(str(path), len(docs)) == shard_counts.ShardCounts(
        len(docs), sum(len(d) for d in docs), None)


def split_count(split, key, value):
    def edit(meta):
        meta["splits"][split][key] = value
    return edit


def file_tokens(meta):
    meta["splits"]["train"]["files"][0]["num_tokens"] = 7


@pytest.mark.parametrize("edit, key, value", [
    (split_count("train", "num_tokens", 7), "splits.train.num_tokens",
     lambda m: m["splits"]["train"]["num_tokens"]),
    (split_count("validation", "num_documents", 1), "splits.validation.num_documents",
     lambda m: m["splits"]["validation"]["num_documents"]),
    (split_count("train", "max_document_tokens", 9), "splits.train.max_document_tokens",
     lambda m: m["splits"]["train"]["max_document_tokens"]),
    (file_tokens, "splits.train.files[0].num_tokens (train-00000.array_record)",
     lambda m: m["splits"]["train"]["files"][0]["num_tokens"]),
    (lambda m: m.update(num_tokens=7), "num_tokens", lambda m: m["num_tokens"]),
    (lambda m: m.update(num_documents=1), "num_documents", lambda m: m["num_documents"]),
])
def test_a_count_the_shards_do_not_hold_is_refused_in_one_sentence(data_dir, tmp_path, edit, key,
                                                                   value):
    """A train token count edited to 7 trained on another stream (the packer's pairs per epoch
    came out negative); each count metadata.json states is now checked against the files."""
    d = edited_copy(data_dir, tmp_path, edit)
    stated = value(json.loads((d / "metadata.json").read_text()))
    held = value(json.loads(open(os.path.join(data_dir, "metadata.json")).read()))
    assert stated != held
    with pytest.raises(ConfigError) as e:
        resolve_dataset(config_at(d))
    assert str(e.value) == (f"{d}/metadata.json disagrees with its shards: {key} is {stated:,} but "
                            f"the files hold {held:,}; prepare the data again with "
                            "scripts/prepare_data.py (or restore metadata.json from a copy).")


def test_data_path_naming_a_file_says_it_is_a_file(data_dir, tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve_dataset(config_at(os.path.join(data_dir, "metadata.json")))
    assert str(e.value) == (f"data.path={data_dir}/metadata.json is a file, not a directory: point "
                            f"it at {data_dir} scripts/prepare_data.py wrote (its --output).")
    text = tmp_path / "corpus.txt"
    text.write_text("some text\n")
    with pytest.raises(ConfigError) as e:
        resolve_dataset(config_at(text))
    assert str(e.value) == (f"data.path={text} is a file, not a directory: point it at the "
                            "directory scripts/prepare_data.py wrote (its --output).")


def test_the_trainer_refuses_it_before_anything_runs(data_dir, tmp_path):
    d = edited_copy(data_dir, tmp_path, split_count("train", "num_tokens", 7))
    r = ScriptServer.run([sys.executable, "scripts/train.py", "--config=configs/base.py:tiny",
                          f"--config.data.path={d}", f"--workdir={tmp_path / 'w'}", "--validate_only"],
                         cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"longctx: {d}/metadata.json disagrees with its shards: splits.train.num_tokens is 7 but")
    assert "Traceback" not in r.stderr
