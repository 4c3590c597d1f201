"""metadata.json against its shards: the counts each ArrayRecord file holds, read from its chunk
headers, never from its records.

An ArrayRecord file is a Riegeli/records file: a sequence of chunks, each with a 40-byte header
that states how many records the chunk decodes to and their total size in bytes
(`decoded_data_size`), and a 24-byte block header at every multiple of 64 KiB. Walking the chunk
headers gives a file's documents, token ids (bytes / 4) and longest document (prepare_data
writes one document per chunk) at one small read per document (about 3 us each: 0.17 s for a
60,000-document, 157 MB shard), without decompressing anything. The layout and the formula for
where the next chunk begins are Riegeli's (doc/riegeli_records_file_format.md).

The trainer checks every count metadata.json states against these at start-up: the packer
plans an epoch from the split's token count, so a count that disagrees with the files would
train on a different stream without a word (a train count edited to 7 gave a negative number of
(input, target) pairs per epoch).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import struct

import numpy as np

from longctx.errors import ConfigError

BLOCK_SIZE = 1 << 16
BLOCK_HEADER_SIZE = 24
CHUNK_HEADER_SIZE = 40
_USABLE_BLOCK_SIZE = BLOCK_SIZE - BLOCK_HEADER_SIZE
_RECORD_CHUNK_TYPES = (ord("r"), ord("t"))  # simple and transposed chunks hold records
_U64 = struct.Struct("<Q")
TOKEN_BYTES = 4  # little-endian int32 ids
_PREPARE_AGAIN = "prepare the data again with scripts/prepare_data.py"


@dataclasses.dataclass(frozen=True)
class ShardCounts:
    num_documents: int
    num_tokens: int
    max_document_tokens: int | None  # None unless each chunk holds one record (prepare_data's)


def _next_chunk(begin: int, data_size: int, num_records: int) -> int:
    """Where the chunk after one that begins at `begin` begins (Riegeli's chunk_end: data and the
    block headers inside it, padded so it spans at least `num_records` bytes and does not end
    inside or right after a block header)."""
    size = CHUNK_HEADER_SIZE + data_size
    overhead = (size + (begin + _USABLE_BLOCK_SIZE - 1) % BLOCK_SIZE) // _USABLE_BLOCK_SIZE
    end = begin + size + overhead * BLOCK_HEADER_SIZE
    least = begin + num_records
    remaining = BLOCK_SIZE - 1 - (least + BLOCK_SIZE - 1) % BLOCK_SIZE
    return max(end, least + max(0, remaining - (_USABLE_BLOCK_SIZE - 1)))


def _chunk_header(data, begin: int) -> bytes:
    """The 40 bytes of the chunk header at `begin`, less any block header that interrupts it."""
    out, pos = b"", begin
    while len(out) < CHUNK_HEADER_SIZE:
        if pos % BLOCK_SIZE < BLOCK_HEADER_SIZE:
            pos += BLOCK_HEADER_SIZE - pos % BLOCK_SIZE
        take = min(CHUNK_HEADER_SIZE - len(out), BLOCK_SIZE - pos % BLOCK_SIZE)
        piece = data[pos:pos + take]
        if len(piece) < take:
            raise EOFError
        out, pos = out + piece, pos + take
    return out


def _record_chunks(path: str, num_records: int) -> list[tuple[int, int]] | None:
    """(records, decoded bytes) of each record chunk of the file, None when its chunk headers
    do not add up to `num_records` records (a damaged file)."""
    chunks, documents, pos = [], 0, 0
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        # The records come first, then ArrayRecord's index (chunks of records of its own): stop
        # once the chunks have held every record the index counts.
        while documents < num_records and pos < len(data):
            header = _chunk_header(data, pos)
            data_size = _U64.unpack_from(header, 8)[0]
            kind_and_records = _U64.unpack_from(header, 24)[0]
            kind, records = kind_and_records & 0xFF, kind_and_records >> 8
            if kind in _RECORD_CHUNK_TYPES:
                chunks.append((records, _U64.unpack_from(header, 32)[0]))
                documents += records
            pos = _next_chunk(pos, data_size, records)
    except EOFError:
        return None
    finally:
        data.close()
    return chunks if documents == num_records else None


@functools.lru_cache(maxsize=4096)
def _counts(path: str, size: int, mtime_ns: int, num_records: int) -> ShardCounts | None:
    del size, mtime_ns  # the cache key: a rewritten file is read again
    chunks = _record_chunks(path, num_records)
    if chunks is None:
        return None
    total_bytes = sum(decoded for _, decoded in chunks)
    if total_bytes % TOKEN_BYTES:
        return None
    one_per_chunk = all(records == 1 for records, _ in chunks)
    longest = max((decoded for _, decoded in chunks), default=0)
    return ShardCounts(num_records, total_bytes // TOKEN_BYTES,
                       longest // TOKEN_BYTES if one_per_chunk else None)


def document_lengths(path: str, num_records: int) -> np.ndarray | None:
    """Every document's token count, in record order, from the chunk headers (prepare_data
    writes one document per chunk); None when a chunk holds several records or the headers do not
    add up (the caller reads the records instead)."""
    chunks = _record_chunks(path, num_records)
    if chunks is None or any(records != 1 for records, _ in chunks):
        return None
    return np.array([decoded for _, decoded in chunks], np.int64) // TOKEN_BYTES


def shard_counts(path: str, num_records: int) -> ShardCounts | None:
    """What the ArrayRecord file at `path` holds, whose index counts `num_records` records; None
    when its chunk headers do not add up to that (a damaged file)."""
    st = os.stat(path)
    return _counts(path, st.st_size, st.st_mtime_ns, num_records)


def _count(n) -> str:
    return f"{n:,}" if isinstance(n, int) else repr(n)


def check_counts(data_dir: str, meta: dict) -> None:
    """ConfigError, in one sentence, unless every count metadata.json states (per file, per split,
    in total) is what the files hold. The files' record counts are checked before this (a file
    whose index disagrees with metadata.json is named as corrupt)."""
    where = os.path.join(data_dir, "metadata.json")

    def refuse(key: str, stated, actual) -> None:
        raise ConfigError(f"{where} disagrees with its shards: {key} is {_count(stated)} but the "
                          f"files hold {_count(actual)}; {_PREPARE_AGAIN} (or restore metadata.json "
                          "from a copy).")

    totals = {"num_documents": 0, "num_tokens": 0}
    for split, info in sorted((meta.get("splits") or {}).items()):
        if not isinstance(info, dict):
            continue
        files = info.get("files") or []
        held = {"num_documents": 0, "num_tokens": 0, "max_document_tokens": 0}
        longest_known = True
        for i, entry in enumerate(files):
            path = os.path.join(data_dir, entry["path"])
            counts = shard_counts(path, int(entry["num_documents"]))
            if counts is None:
                raise ConfigError(f"{path} is corrupt: its chunk headers do not add up to the "
                                  f"{entry['num_documents']:,} records of its index; "
                                  f"{_PREPARE_AGAIN} (or restore the file from a copy).")
            if entry.get("num_tokens") is not None and entry["num_tokens"] != counts.num_tokens:
                refuse(f"splits.{split}.files[{i}].num_tokens ({entry['path']})",
                       entry["num_tokens"], counts.num_tokens)
            held["num_documents"] += counts.num_documents
            held["num_tokens"] += counts.num_tokens
            if counts.max_document_tokens is None:
                longest_known = False
            else:
                held["max_document_tokens"] = max(held["max_document_tokens"],
                                                  counts.max_document_tokens)
        if not longest_known:
            del held["max_document_tokens"]
        for key, actual in held.items():
            if key in info and info[key] != actual:
                refuse(f"splits.{split}.{key}", info[key], actual)
            if key in totals:
                totals[key] += actual
    for key, actual in totals.items():
        if key in meta and meta[key] != actual:
            refuse(key, meta[key], actual)
