"""Structured inputs of prepare_data: one document per JSONL line or table row.

  .jsonl  .jsonl.gz  .jsonl.zst   one JSON object per line, the document in --text-field
  .parquet                        a table, the document in the string column --text-field
  .arrow                          the Arrow stream files Hugging Face `datasets.save_to_disk`
                                  writes (data-00000-of-00001.arrow ...), the column --text-field

A directory that `save_to_disk` wrote (state.json, dataset_info.json and .arrow files) gives its
.arrow files only. Parquet and Arrow need pyarrow, .zst needs zstandard (the `formats` extra:
pip install -e '.[formats]'); each is imported only when such a file is read. Every failure is
one sentence naming the file and, where it has one, the line or row: a missing field or column,
a value that is not a string, a file that does not decompress or parse.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from typing import Iterator

from longctx import errors
from longctx.errors import ConfigError

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLES = (".parquet", ".arrow")
HF_DISK_FILES = ("state.json", "dataset_info.json")  # what datasets.save_to_disk writes beside .arrow
_EXTRA = "pip install -e '.[formats]'"


def is_structured(path: str) -> bool:
    return path.endswith(JSONL + TABLES)


def is_hf_disk_dataset(directory: str) -> bool:
    """A directory `datasets.save_to_disk` wrote (its .arrow files are the documents)."""
    return all(os.path.isfile(os.path.join(directory, f)) for f in HF_DISK_FILES)


def _need(module: str, path: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"{path} needs the Python package {module}, which is not installed: "
                          f"{_EXTRA}.") from None


def _open_text_lines(path: str):
    """The file's lines as bytes, decompressed by its suffix."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return contextlib.closing(_zstd_lines(path, _need("zstandard", path)))
    return open(path, "rb")


def _zstd_lines(path: str, zstandard, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a .zst file (one frame or several); a file that ends inside a frame raises
    EOFError (zstandard's stream reader ends there without a word, and a truncated block yields
    nothing at all)."""
    pending, decoder = b"", zstandard.ZstdDecompressor().decompressobj()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            while data:
                pending += decoder.decompress(data)
                data = decoder.unused_data if decoder.eof else b""
                if decoder.eof and data:  # the next frame
                    decoder = zstandard.ZstdDecompressor().decompressobj()
            *lines, pending = pending.split(b"\n")
            yield from (line + b"\n" for line in lines)
    if not decoder.eof:
        raise EOFError("the file ends inside a zstd frame")
    if pending:
        yield pending


def _text(value, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} field {text_field!r} is not a string ({type(value).__name__}); "
                          "choose the text field with --text-field.")
    return value


def documents(path: str, key: str, text_field: str, blank: list) -> Iterator[tuple[str, bytes]]:
    """(key:line or key:row, utf-8 bytes) for every non-blank document of a structured file; the
    keys of blank ones are appended to `blank`."""
    rows = _jsonl_rows(path, text_field) if path.endswith(JSONL) else _table_rows(path, text_field)
    for number, text in rows:
        if text.strip():
            yield f"{key}:{number}", text.encode("utf-8")
        else:
            blank.append(f"{key}:{number}")


def _jsonl_rows(path: str, text_field: str) -> Iterator[tuple[int, str]]:
    lineno = 0
    try:
        with _open_text_lines(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ConfigError(f"{path}:{lineno} is not valid JSON "
                                      f"({getattr(e, 'msg', None) or e.reason}).") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ConfigError(f"{path}:{lineno} has no field {text_field!r} "
                                      "(choose it with --text-field).")
                yield lineno, _text(obj[text_field], f"{path}:{lineno}", text_field)
    except ConfigError:
        raise
    except (OSError, EOFError, ValueError) as e:  # gzip/zstd: bad magic, truncated, bad checksum
        raise ConfigError(f"{path} is corrupt after line {lineno}: it does not decompress "
                          f"({errors.first_line(e) or type(e).__name__}); replace it with a good "
                          "copy.") from None


def _table_rows(path: str, text_field: str) -> Iterator[tuple[int, str]]:
    pa = _need("pyarrow", path)
    batches, schema = _record_batches(pa, path)
    if text_field not in schema.names:
        raise ConfigError(f"{path} has no column {text_field!r} (its columns: "
                          f"{', '.join(schema.names)}); choose it with --text-field.")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"{path} column {text_field!r} holds {kind}, not strings; choose the text "
                          "column with --text-field.")
    row = 0
    try:
        for batch in batches:
            for value in batch.column(text_field).to_pylist():
                row += 1
                if value is None:
                    raise ConfigError(f"{path} row {row} has no {text_field!r} (null).")
                yield row, value
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path} is corrupt after row {row}: {_first(e)}; replace it with a good "
                          "copy.") from None


def _record_batches(pa, path: str):
    """(an iterator of record batches, the schema) of a Parquet file or an Arrow stream/file."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq  # lazily: pyarrow is an optional extra (formats)

            f = pq.ParquetFile(path)
            return f.iter_batches(), f.schema_arrow
        import pyarrow.ipc as ipc  # lazily: pyarrow is an optional extra (formats)

        try:
            reader = ipc.open_stream(pa.memory_map(path))  # what save_to_disk writes
        except pa.ArrowInvalid:
            reader = ipc.open_file(pa.memory_map(path))
            return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema
        return iter(reader), reader.schema
    except (pa.ArrowException, OSError) as e:
        what = "Parquet" if path.endswith(".parquet") else "Arrow"
        raise ConfigError(f"{path} is not a readable {what} file ({_first(e)}); replace it with a "
                          "good copy.") from None


def _first(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text[:200] or type(error).__name__
