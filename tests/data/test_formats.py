"""prepare_data's structured inputs (longctx/data/formats.py): .jsonl.gz and .jsonl.zst, Parquet and
the Arrow files of Hugging Face `datasets.save_to_disk`, each giving the same documents as the
plain .jsonl, and one sentence, naming the file and row, for each bad input.

Parquet and Arrow need pyarrow, .zst zstandard: both are in setup.cfg's `test` extra (and in
`formats`), imported here plainly so that a set-up without them fails, not skips."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from longctx.data import pipeline, prepare
from longctx.errors import ConfigError

TEXTS = ["first document", "the second one, longer than the first", "   ", "third"]


def _documents(out_dir) -> list[bytes]:
    meta = pipeline.load_metadata(str(out_dir))
    docs = []
    for split in prepare.SPLITS:
        if meta["splits"][split]["num_documents"]:
            source = pipeline.TokenSource(str(out_dir), split, meta)
            docs += [np.asarray(source[i]).tobytes() for i in range(len(source))]
    return sorted(docs)


def _prepare(path, out, **kw):
    return prepare.prepare([str(path)], str(out), val_fraction=0.0, progress=False, **kw)


def _jsonl_bytes(texts=TEXTS, field="text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


@pytest.fixture
def reference(tmp_path):
    (tmp_path / "ref.jsonl").write_bytes(_jsonl_bytes())
    meta = _prepare(tmp_path / "ref.jsonl", tmp_path / "ref")
    assert meta["num_documents"] == 3 and meta["num_empty_documents"] == 1
    return _documents(tmp_path / "ref")


def test_gzipped_jsonl_gives_the_same_documents(tmp_path, reference):
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes()))
    _prepare(tmp_path / "c.jsonl.gz", tmp_path / "out")
    assert _documents(tmp_path / "out") == reference


def test_zstd_jsonl_gives_the_same_documents(tmp_path, reference):
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes()))
    _prepare(tmp_path / "c.jsonl.zst", tmp_path / "out")
    assert _documents(tmp_path / "out") == reference


def test_parquet_column_by_text_field(tmp_path, reference):
    pq.write_table(pa.table({"id": list(range(4)), "body": TEXTS}), tmp_path / "c.parquet",
                   row_group_size=2)
    _prepare(tmp_path / "c.parquet", tmp_path / "out", text_field="body")
    assert _documents(tmp_path / "out") == reference


def test_hf_save_to_disk_directory_reads_its_arrow_files_only(tmp_path, reference):
    """The layout `datasets.save_to_disk` writes: Arrow stream files beside state.json and
    dataset_info.json (made here with pyarrow; the datasets package is not needed)."""
    disk = tmp_path / "hf"
    disk.mkdir()
    table = pa.table({"text": TEXTS, "id": list(range(4))})
    for i, part in enumerate((table.slice(0, 3), table.slice(3))):
        with pa.OSFile(str(disk / f"data-0000{i}-of-00002.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(part)
    (disk / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"}]}))
    (disk / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    meta = _prepare(disk, tmp_path / "out")
    assert meta["num_source_files"] == 2
    assert _documents(tmp_path / "out") == reference


def _corrupt_zst(tmp_path):
    data = zstandard.ZstdCompressor().compress(_jsonl_bytes() * 50)
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    return path


def _table(tmp_path, suffix, columns):
    path = tmp_path / f"t{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table(columns), path)
    else:
        table = pa.table(columns)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda t: t.joinpath("a.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes(field="body"))) and t / "a.jsonl.gz",
     r"a.jsonl.gz:1 has no field 'text' \(choose it with --text-field\)."),
    (lambda t: t.joinpath("b.jsonl.gz").write_bytes(gzip.compress(_jsonl_bytes())[:-12]) and t / "b.jsonl.gz",
     r"b.jsonl.gz is corrupt after line 3: it does not decompress \(.*\); replace it with a good copy."),
    (lambda t: t.joinpath("c.jsonl.gz").write_bytes(gzip.compress(b'{"text": 3}\n')) and t / "c.jsonl.gz",
     r"c.jsonl.gz:1 field 'text' is not a string \(int\); choose the text field with --text-field."),
    (_corrupt_zst, r"bad.jsonl.zst is corrupt after line \d+: it does not decompress"),
    (lambda t: _table(t, ".parquet", {"body": ["x"]}),
     r"t.parquet has no column 'text' \(its columns: body\); choose it with --text-field."),
    (lambda t: _table(t, ".parquet", {"text": [1, 2]}),
     r"t.parquet column 'text' holds int64, not strings; choose the text column with --text-field."),
    (lambda t: _table(t, ".arrow", {"text": ["a", None]}), r"t.arrow row 2 has no 'text' \(null\)."),
    (lambda t: t.joinpath("d.parquet").write_bytes(b"PAR1 not really") and t / "d.parquet",
     r"d.parquet is not a readable Parquet file \(.*\); replace it with a good copy."),
])
def test_bad_structured_input_is_one_sentence(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as e:
        _prepare(path, tmp_path / "out")
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_package_is_named_with_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"x.parquet needs the Python package pyarrow, which is not "
                                          r"installed: pip install -e '.\[formats\]'."):
        _prepare(tmp_path / "x.parquet", tmp_path / "out")
