"""Corpus -> ArrayRecord shards of int32 token ids + metadata.json.

Output directory layout (what `scripts/prepare_data.py` writes and the pipeline reads):

  metadata.json                  tokenizer spec, vocab_size, bos/eos/pad ids, per-split files and
                                 document/token counts, the input sources
  train-00000.array_record ...   one record per document: little-endian int32 ids, BOS ... EOS
  validation-00000.array_record
  tokenizer.model                only for SentencePiece (copied or trained), so the directory is
                                 self-contained
  tokenizer.json                 only for hf: tokenizers (copied, with a tokenizer_config.json that
                                 names its BOS/EOS/PAD); metadata.json records "hf:tokenizer.json"

  .longctx-dataset               a marker, written first: this directory is prepare_data's output
                                 (or being written), never its input

Inputs: plain files (one document each), `.jsonl` (also `.jsonl.gz`, `.jsonl.zst`: one document
per non-blank line, taken from `text_field`), Parquet and Hugging Face `save_to_disk` Arrow files
(one document per row of the column `text_field`; formats.py), and directories (every file below that matches `glob`, walked in sorted order).
A dataset directory met in a walk (the marker, or a metadata.json of this format: e.g. the
output itself when --output lies inside an input directory, or its temporary sibling) is left
out, and giving one, or a file inside one, as an input is an error: prepare_data never reads its
own output. Blank documents (empty or whitespace only) are dropped and counted
(`num_empty_documents`, `empty_document_example`). A plain file that is not text in `encoding` (default UTF-8: it does
not decode, or it holds NUL characters) is skipped and counted (`num_skipped_files` and
`skipped_file_example` in metadata.json): binary files in a directory of text would otherwise
become documents of noise. Documents are tokenized as UTF-8 (a UTF-8 file's bytes as they are). Each document goes to validation when a hash of its key
(relative path, plus `:line` for jsonl) falls below `val_fraction`; if that leaves validation
empty the document with the smallest hash is moved there, so a small corpus still has a
validation split. Nothing depends on time, file-system order or randomness, so re-running on the
same input writes byte-identical files.

The embedded default corpus (`prepare_stdlib`) is the running Python's standard-library `.py`
sources, without `site-packages` and test directories.
"""

from __future__ import annotations

import codecs
import dataclasses
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Iterator, Sequence

import numpy as np

from longctx.data import formats
from longctx.data import tokenizer as tokenizer_lib
from longctx import errors
from longctx.errors import ConfigError, MissingFileError, RunError

METADATA = "metadata.json"
DATASET_MARKER = ".longctx-dataset"
FORMAT = "longctx.tokens.v1"
SPLITS = ("train", "validation")
TOKENIZER_FILE = "tokenizer.model"
# A shard is closed once it holds this many token bytes; ~256 MiB keeps per-file reads parallel
# across hosts without creating thousands of tiny files.
DEFAULT_SHARD_BYTES = 256 << 20
# Standard-library directories that are not ordinary source: vendored packages and test suites
# (the latter include deliberately malformed files).
STDLIB_EXCLUDE_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                                 "__pycache__"})


@dataclasses.dataclass(frozen=True)
class Source:
    """One input file: its path on disk and the stable key used for hashing and metadata."""

    path: str
    key: str


def is_dataset_dir(path: str) -> bool:
    """True for a directory that prepare_data wrote or is writing: its marker, or (a dataset from
    before the marker) a metadata.json of this format."""
    if os.path.isfile(os.path.join(path, DATASET_MARKER)):
        return True
    try:
        with open(os.path.join(path, METADATA)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # none, unreadable, not JSON, not an object
        return False


def _not_a_dataset(inp: str) -> None:
    """ConfigError for an input that is a dataset directory or a file inside one."""
    where = inp if os.path.isdir(inp) else os.path.dirname(os.path.abspath(inp))
    if is_dataset_dir(where):
        what = "is" if where is inp else f"is a file of {where}, which is"
        raise ConfigError(f"input {inp} {what} a prepared longctx dataset, not text to prepare; "
                          "give the text it was prepared from.")


def list_sources(inputs: Sequence[str], glob: str = "*",
                 exclude_dirs: frozenset = frozenset()) -> list[Source]:
    """Expands files and directory trees (sorted walk, pruning `exclude_dirs` and dataset
    directories) into input files."""
    if not inputs:
        raise ConfigError("no --input given.")
    out: list[Source] = []
    for inp in inputs:
        if os.path.isdir(inp):
            _not_a_dataset(inp)
            found = []
            for d, dirs, files in os.walk(inp):
                dirs[:] = sorted(x for x in dirs if x not in exclude_dirs
                                 and not is_dataset_dir(os.path.join(d, x)))
                if formats.is_hf_disk_dataset(d):  # its .arrow files hold the documents
                    files = [f for f in files if f.endswith(".arrow")]
                for f in sorted(files):
                    if fnmatch.fnmatch(f, glob):
                        full = os.path.join(d, f)
                        found.append(Source(full, os.path.relpath(full, inp).replace(os.sep, "/")))
            if not found:
                raise ConfigError(f"input directory {inp} has no files matching --glob {glob!r}.")
            out.extend(found)
        elif os.path.isfile(inp):
            _not_a_dataset(inp)
            out.append(Source(inp, os.path.basename(inp)))
        else:
            raise MissingFileError(f"input {inp} does not exist.")
    return out


def text_problem(data: bytes, encoding: str = "utf-8") -> str | None:
    """Why `data` is not text in `encoding` ("not valid utf-8", "NUL bytes"), or None if it is."""
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError:
        return f"not valid {encoding}"
    if "\x00" in text:
        return "NUL bytes"
    return None


class NotText(Exception):
    """A plain input file that is not text in the chosen encoding (skipped, and counted)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def iter_documents(src: Source, text_field: str = "text", encoding: str = "utf-8",
                   blank: list | None = None) -> Iterator[tuple[str, bytes]]:
    """(key, utf-8 bytes) for every document in one input file that is not blank; the keys of
    blank documents (empty or whitespace only: nothing to learn from, and a whitespace-only
    document would pass as one) are appended to `blank` instead.

    Raises NotText, before yielding anything, for a plain file that is not text in `encoding`.
    """
    blank = [] if blank is None else blank
    if formats.is_structured(src.path):  # JSONL (also .gz, .zst), Parquet, Arrow: formats.py
        yield from formats.documents(src.path, src.key, text_field, blank)
    else:
        with open(src.path, "rb") as f:
            data = f.read()
        if not data:
            blank.append(src.key)
            return
        problem = text_problem(data, encoding)
        if problem is not None:
            raise NotText(src.path, problem)
        text = data.decode(encoding)
        if not text.strip():
            blank.append(src.key)
            return
        if _codec(encoding) != "utf-8":
            data = text.encode("utf-8")
        yield src.key, data


def _codec(encoding: str) -> str:
    return codecs.lookup(encoding).name


def split_hash(key: str) -> float:
    """Uniform in [0, 1), a pure function of the document key."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


class _ShardWriter:
    """Writes one split's records into numbered ArrayRecord files of bounded size."""

    def __init__(self, out_dir: str, split: str, shard_bytes: int):
        self.out_dir, self.split, self.shard_bytes = out_dir, split, shard_bytes
        self.files: list[dict] = []
        self._writer = None

    def write(self, ids: np.ndarray) -> None:
        # lazily: importing prepare (the data CLI's checks, the embedded corpus's name) needs no writer
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None:
            name = f"{self.split}-{len(self.files):05d}.array_record"
            # group_size:1 = one record per chunk, the setting for random access by index.
            self._writer = ArrayRecordWriter(os.path.join(self.out_dir, name), "group_size:1")
            self.files.append({"path": name, "num_documents": 0, "num_tokens": 0})
        self._writer.write(ids.astype("<i4", copy=False).tobytes())
        entry = self.files[-1]
        entry["num_documents"] += 1
        entry["num_tokens"] += int(ids.size)
        if entry["num_tokens"] * 4 >= self.shard_bytes:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _write_splits(sources, tok, out_dir, *, text_field, encoding, val_fraction, shard_bytes,
                  force_val, progress):
    """One pass over the inputs; returns (per-split stats, key of the smallest-hash document,
    the files skipped as not text, the keys of the blank documents dropped)."""
    writers = {s: _ShardWriter(out_dir, s, shard_bytes) for s in SPLITS}
    max_len = {s: 0 for s in SPLITS}
    min_key, min_h = None, 2.0
    tokens = 0
    skipped: list[NotText] = []
    blank: list[str] = []
    shown = _Progress(len(sources), progress)
    for src in sources:
        for key, data in _text_documents(src, text_field, encoding, skipped, blank):
            h = split_hash(key)
            if h < min_h:
                min_key, min_h = key, h
            split = "validation" if (h < val_fraction or key == force_val) else "train"
            ids = tok.encode_document(data)
            if ids.size and int(ids.max()) >= tok.vocab_size:
                raise ConfigError(f"{src.path}: token id {int(ids.max())} >= vocab size {tok.vocab_size}.")
            writers[split].write(ids)
            max_len[split] = max(max_len[split], int(ids.size))
            tokens += int(ids.size)
        shown.file_done(tokens)
    shown.close()
    stats = {}
    for s, w in writers.items():
        w.close()
        stats[s] = {
            "files": w.files,
            "num_documents": sum(f["num_documents"] for f in w.files),
            "num_tokens": sum(f["num_tokens"] for f in w.files),
            "max_document_tokens": max_len[s],
        }
    return stats, min_key, skipped, blank


# How often a log (stderr not a terminal) gets a progress line.
LOG_EVERY_S = 30.0


class _Progress:
    """Progress over the input files: tqdm's bar when stderr is a terminal; in a log (stderr
    redirected) a plain line every LOG_EVERY_S seconds instead, where the bar's redraws would pile
    up as carriage returns; nothing when `show` is False."""

    def __init__(self, num_files: int, show: bool):
        self.num_files, self.done = num_files, 0
        self.bar = None
        self.log = show and not sys.stderr.isatty()
        if show and not self.log:
            from tqdm import tqdm  # lazily: only a pass over the inputs on a terminal shows a bar

            self.bar = tqdm(total=num_files, unit="file", desc="prepare", dynamic_ncols=True)
        self.start = self.last = time.monotonic()

    def file_done(self, tokens: int) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
            self.bar.update(1)
        elif self.log:
            now = time.monotonic()
            if now - self.last >= LOG_EVERY_S:
                self.last = now
                print(f"prepare: {self.done:,} of {self.num_files:,} files, {tokens:,} tokens, "
                      f"{now - self.start:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _text_documents(src: Source, text_field: str, encoding: str, skipped: list,
                    blank: list | None = None):
    """`iter_documents`, where a file that is not text yields nothing and joins `skipped`."""
    try:
        yield from iter_documents(src, text_field, encoding, blank)
    except NotText as e:  # raised before the file's first document, so nothing half-done
        skipped.append(e)


def _sentencepiece_texts(sources, text_field, encoding):
    for src in sources:
        for _, data in _text_documents(src, text_field, encoding, []):
            yield data.decode("utf-8", errors="replace")


def write_dataset(inputs: Sequence[str], out_dir: str, *, tokenizer: str = "byte",
                  text_field: str = "text", encoding: str = "utf-8", glob: str = "*",
                  val_fraction: float = 0.01,
                  train_sentencepiece: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                  progress: bool = True, sources_label: Sequence[str] | None = None,
                  exclude_dirs: frozenset = frozenset()) -> dict:
    """Tokenizes `inputs` into the (existing, empty) directory `out_dir`; returns the metadata."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction={val_fraction} must be in [0, 1).")
    try:
        _codec(encoding)
    except LookupError:
        raise ConfigError(f"--encoding {encoding!r} is not a text encoding Python knows.") from None
    # First, so that a walk of an input directory that holds `out_dir` leaves it out.
    with open(os.path.join(out_dir, DATASET_MARKER), "w") as f:
        f.write("written by longctx prepare_data: a dataset, never read as its input\n")
    sources = list_sources(inputs, glob, exclude_dirs)

    if train_sentencepiece:
        if tokenizer != "byte":
            raise ConfigError("--train-sentencepiece trains a new model; do not also pass --tokenizer.")
        model = os.path.join(out_dir, TOKENIZER_FILE)
        tokenizer_lib.train_sentencepiece(_sentencepiece_texts(sources, text_field, encoding),
                                          int(train_sentencepiece), model)
        tok = tokenizer_lib.sentencepiece_tokenizer(model)
    elif tokenizer.startswith("sentencepiece:"):
        model = tokenizer.split(":", 1)[1]
        tok = tokenizer_lib.sentencepiece_tokenizer(model)  # validates before copying
        shutil.copyfile(model, os.path.join(out_dir, TOKENIZER_FILE))
        tok = tokenizer_lib.sentencepiece_tokenizer(os.path.join(out_dir, TOKENIZER_FILE))
    elif tokenizer.startswith("hf:"):
        # tokenizer.json is copied and the special tokens it was read with are written beside it,
        # so the directory is self-contained (the source's BOS/EOS may have come from a
        # config.json that is not copied), and the copy is what is used.
        tokenizer_lib.write_hf_tokenizer(tokenizer.split(":", 1)[1], out_dir)
        tok = tokenizer_lib.hf_tokenizer(os.path.join(out_dir, tokenizer_lib.HF_TOKENIZER_FILE))
    else:
        tok = tokenizer_lib.load_tokenizer(tokenizer)
    spec = f"sentencepiece:{TOKENIZER_FILE}" if tok.name.startswith("sentencepiece:") else tok.name

    kw = dict(text_field=text_field, encoding=encoding, val_fraction=val_fraction,
              shard_bytes=shard_bytes, progress=progress)
    stats, min_key, skipped, blank = _write_splits(sources, tok, out_dir, force_val=None, **kw)
    n_docs = sum(s["num_documents"] for s in stats.values())
    if n_docs == 0:
        why = (f"all inputs are empty or not {encoding} text: {len(skipped)} of {len(sources)} "
               f"file(s) skipped, e.g. {skipped[0]}" if skipped else
               "all documents are empty or whitespace only")
        raise ConfigError(f"no documents found in {', '.join(inputs)} ({why}).")
    if val_fraction > 0 and stats["validation"]["num_documents"] == 0 and n_docs >= 2:
        # Rare on real corpora; a second pass keeps the split a pure function of the input.
        for f in os.listdir(out_dir):
            if f.endswith(".array_record"):
                os.remove(os.path.join(out_dir, f))
        stats, _, _, _ = _write_splits(sources, tok, out_dir, force_val=min_key, **kw)

    meta = {
        "format": FORMAT,
        "record": "one document per record: little-endian int32 token ids, BOS ... EOS",
        "tokenizer": spec,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "num_documents": n_docs,
        "num_tokens": sum(s["num_tokens"] for s in stats.values()),
        "splits": stats,
        "sources": list(sources_label if sources_label is not None else inputs),
        "num_source_files": len(sources),
        "num_skipped_files": len(skipped),
        "skipped_file_example": f"{skipped[0].path} ({skipped[0].reason})" if skipped else None,
        "num_empty_documents": len(blank),
        "empty_document_example": blank[0] if blank else None,
        "encoding": _codec(encoding),
        "glob": glob,
        "text_field": text_field,
        "val_fraction": val_fraction,
    }
    with open(os.path.join(out_dir, METADATA), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    return meta


def empty_split_warnings(meta: dict) -> list[str]:
    """One sentence for each empty split of a prepared dataset: the trainer refuses a dataset
    without train documents, and one without validation documents when it evaluates."""
    splits, n, fraction = meta["splits"], meta["num_documents"], meta["val_fraction"]
    out = []
    if not splits["validation"]["num_documents"]:
        why = "--val-fraction is 0" if not fraction else f"{n} document(s) cannot fill two splits"
        out.append(f"the validation split is empty ({why}), so training with evaluation "
                   "(train.eval_every > 0) refuses this dataset; prepare it again with "
                   "--val-fraction above 0 from more documents, or train with "
                   "--config.train.eval_every=0.")
    if not splits["train"]["num_documents"]:
        out.append(f"the train split is empty (all {n} document(s) went to validation with "
                   f"--val-fraction {fraction}), so training refuses this dataset; prepare it "
                   "again with a smaller --val-fraction or from more documents.")
    return out


def prepare(inputs: Sequence[str], output: str, *, overwrite: bool = False, **kwargs) -> dict:
    """`write_dataset` into a temporary sibling, then swapped into `output` in one rename.

    A reader never sees a half-written directory, and an interrupted run leaves `output` as it
    was. An existing `output` is replaced only with `overwrite=True` (an empty directory needs
    no permission), and only if it is a dataset (has metadata.json).
    """
    output = os.path.abspath(output)
    if os.path.exists(output):
        if not os.path.isdir(output) or (os.listdir(output)
                                         and not os.path.exists(os.path.join(output, METADATA))):
            raise ConfigError(f"--output {output} exists and is not a longctx dataset directory; "
                              "choose another --output.")
        if os.listdir(output) and not overwrite:
            raise ConfigError(f"--output {output} already holds a dataset; pass --overwrite to "
                              "replace it, or choose another --output.")
    parent = os.path.dirname(output)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(output) + ".tmp-", dir=parent)
    except OSError as e:  # a read-only file system, a file in the way, no permission
        raise ConfigError(f"--output {output} cannot be written ({_why_unwritable(parent, e)}); "
                          "choose another --output.") from None
    try:
        try:
            meta = write_dataset(inputs, tmp, **kwargs)
        except (OSError, RuntimeError) as e:  # RuntimeError: ArrayRecord's writer
            reason = _write_failure(e, tmp)
            if reason is None:
                raise
            raise RunError(f"prepare_data could not write --output {output} ({reason}); {output} "
                           "is as it was: free space there or choose another --output.") from None
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        if os.path.exists(output):
            old = tempfile.mkdtemp(prefix=os.path.basename(output) + ".old-", dir=parent)
            os.rename(output, os.path.join(old, "d"))
            os.rename(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, output)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _why_unwritable(parent: str, error: OSError) -> str:
    """'<file> is a file, not a directory' when one is in the way of `parent`, else the system's
    reason with its errno (never the temporary directory's name: it was never made)."""
    p = parent
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    if os.path.exists(p) and not os.path.isdir(p):
        return f"{p} is {'a file' if os.path.isfile(p) else 'there'}, not a directory"
    return errors.os_reason(error)


def _write_failure(error: Exception, tmp: str) -> str | None:
    """Why a write into the temporary output `tmp` failed (a full disk, a file-size limit), or
    None for an error that is not one (an input that cannot be read names itself). A write
    reports no file name (ArrayRecord's writer names it in its message); the reason given leaves
    the temporary directory's name out."""
    if isinstance(error, errors.LongctxError):  # an input's own sentence (MissingFileError)
        return None
    if isinstance(error, OSError):
        named = [f for f in (error.filename, error.filename2) if isinstance(f, str)]
        if any(not (f + os.sep).startswith(tmp + os.sep) for f in named):
            return None
        return errors.os_reason(error)
    message = str(error)
    return message.split(";")[0].strip() if tmp in message else None


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_cache_name() -> str:
    """Directory name for the embedded corpus: changes with the Python build and the format."""
    root = stdlib_root()
    tag = hashlib.sha256(f"{root}|{sys.version}|{FORMAT}".encode()).hexdigest()[:10]
    return f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-byte-{tag}"


def stdlib_dir(cache_dir: str) -> str:
    """Where `prepare_stdlib` prepares the per-file corpus (whether or not it has yet)."""
    return os.path.join(os.path.abspath(cache_dir), stdlib_cache_name())


def stdlib_packages_dir(cache_dir: str) -> str:
    """Where `prepare_stdlib_packages` prepares the per-package corpus (whether or not it has yet)."""
    return os.path.join(os.path.abspath(cache_dir), stdlib_cache_name().replace("stdlib-", "stdlib-packages-", 1))


def prepare_stdlib(cache_dir: str, progress: bool = False) -> str:
    """Prepares the standard-library corpus (one document per file) under `cache_dir` once;
    returns its directory."""
    final = stdlib_dir(cache_dir)

    def write(tmp: str) -> None:
        write_dataset([stdlib_root()], tmp, glob="*.py", val_fraction=0.01, progress=progress,
                      sources_label=["python-stdlib"], exclude_dirs=STDLIB_EXCLUDE_DIRS)

    return _prepare_once(final, write, f"the Python standard library in {stdlib_root()}")


def stdlib_packages(root: str | None = None) -> dict[str, bytes]:
    """`{package: its document}` for every top-level package of the standard library: the
    package's `.py` files (test directories left out, as in the per-file corpus) in sorted path
    order, each after a `# <path>` line, as ProLong's long code documents are whole repositories."""
    root = root or stdlib_root()
    out = {}
    for name in sorted(os.listdir(root)):
        top = os.path.join(root, name)
        if name in STDLIB_EXCLUDE_DIRS or not os.path.isfile(os.path.join(top, "__init__.py")):
            continue
        parts = []
        for src in list_sources([top], "*.py", STDLIB_EXCLUDE_DIRS):
            with open(src.path, "rb") as f:
                data = f.read()
            if text_problem(data) is None:
                parts.append(f"# {name}/{src.key}\n".encode() + data)
        if parts:
            out[name] = b"\n".join(parts)
    return out


def prepare_stdlib_packages(cache_dir: str, progress: bool = False) -> str:
    """Prepares the long-document corpus (`stdlib_packages`: one document per top-level package,
    a tenth of them for validation) under `cache_dir` once; returns its directory."""
    final = stdlib_packages_dir(cache_dir)

    def write(tmp: str) -> None:
        with tempfile.TemporaryDirectory(prefix="stdlib-packages-", dir=os.path.dirname(tmp)) as texts:
            for name, data in stdlib_packages().items():
                with open(os.path.join(texts, name), "wb") as f:
                    f.write(data)
            write_dataset([texts], tmp, val_fraction=0.1, progress=progress,
                          sources_label=["python-stdlib-packages"])

    return _prepare_once(final, write, f"the Python standard library in {stdlib_root()}, one "
                         "document per top-level package")


def _prepare_once(final: str, write, what: str) -> str:
    """Writes the dataset `final` with `write(tmp)` unless it exists; returns `final`.

    Safe when several processes race: each writes a private temporary directory and renames it
    into place; the rename of a directory onto an existing non-empty one fails, so the first
    finisher wins and the others discard their copy (identical anyway).
    """
    if os.path.exists(os.path.join(final, METADATA)):
        return final
    # Half a minute or more of tokenizing on a first run: say what it is before it starts (on
    # stderr, where progress goes: stdout is the caller's, and "longctx: " there is an error's).
    print(f"preparing the embedded corpus ({what}) once, into {final}; later runs reuse it ...",
          file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=os.path.dirname(final))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.exists(os.path.join(final, METADATA)):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
