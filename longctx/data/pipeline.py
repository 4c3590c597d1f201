"""The Grain pipeline: ArrayRecord documents -> packed, laid-out, globally sharded batches.

  ArrayRecord source (one document per record)
  -> shuffle (seeded, reshuffled every epoch) -> repeat
  -> this data shard's documents: [shard_index::shard_count] (only those records are ever read)
  -> to_iter_dataset (threaded reads)
  -> split each document into (input, target) pieces of <= seq_len     (packing.SplitDocument)
  -> Grain packer: first_fit | best_fit | concat_then_split           (packing.pack)
     or shard_balanced: documents placed into the sp shards            (dispatch.py)
  -> tokens, segment_ids, positions, targets, loss_mask per row       (packing.RowFeatures)
  -> batch of local rows -> permute the sequence axis into the sp layout
  -> Grain worker processes (mp_prefetch) or a prefetch thread
  -> BatchIterator: global jax.Arrays, rows over (dp, fsdp), sequence over sp.

Checkpointing the iterator with Orbax (grain 0.2.18 + orbax-checkpoint 0.12.8): the state lives
entirely in the Grain iterator, `batch_iterator.grain_iterator`, and BatchIterator holds nothing
of its own (no prefetch of device arrays), so that state is exactly "the next batch to yield".
In a CheckpointManager composite use grain's own handler args:

    import grain
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data_iter=grain.checkpoint.CheckpointSave(batch_iterator.grain_iterator)))
    mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data_iter=grain.checkpoint.CheckpointRestore(batch_iterator.grain_iterator)))

(`grain.python.PyGrainCheckpointSave/Restore` are the same classes under their old names.) The
handler writes `process_<i>-of-<n>.json` per process, each with that process's iterator state,
and restores in place. A restored iterator continues exactly where the saved one stopped, given
the same data directory, config (seq_len, batch, packer, seeds, num_workers), process count and
process -> data shard map. `BatchIterator.stream_record()` is what, beyond the config, a saved state
depends on: every process's data shard, the train split's fingerprint (`dataset_fingerprint`) and
the values of the keys the packer's rows depend on (`packing.Packer.row_keys`: sp and the block
size for shard_balanced, the bins...); longctx.train.checkpoint saves it beside the state and
restarts the stream when it differs.
`BatchIterator.get_state()/set_state()` give the same JSON-serializable dict for other uses.

Validation uses the same packer with no shuffle, fixed seeds, few bins and no worker processes,
repeated without end, so every fresh iterator yields the same batches, starting with the first
documents of the split, and an eval loop can take any number of them (all processes agree on
the count; past one pass the documents repeat). Training order depends on data.shuffle_seed
(+ seed_offset) only, not on config.seed, so runs that differ in model seed see the same data.

Batch format (packing.py has the details): int32 `[global_batch, seq_len]` arrays `tokens`,
`segment_ids` (1, 2, ... per document in a row; 0 = padding), `positions` (restart at 0 per
segment), `targets` (next token of the same document), `loss_mask` (1 on real tokens, 0 on
padding), all permuted along the sequence by `longctx.parallel.layout.permutation(layout, seq_len, sp)`.
"""

from __future__ import annotations

import bisect
import errno
import functools
import json
import os

import grain
import numpy as np
from grain import experimental as gx

from longctx import errors
from longctx.data import packing
from longctx.data import prepare as prepare_lib
from longctx.data import shard_counts
from longctx.data import sharding as sharding_lib
from longctx.errors import ConfigError, MissingFileError
from longctx.parallel import layout as layout_lib

_SPLIT_NAMES = {"train": "train", "validation": "validation", "eval": "validation"}
_REQUIRED_META = ("tokenizer", "vocab_size", "bos_id", "eos_id", "pad_id", "splits")
_REDO = "prepare the data again with scripts/prepare_data.py (or restore the file from a copy)."


def _reason(error: Exception) -> str:
    """` (Type: first line of the message)`, or "" when the reader gave no message."""
    text = " ".join(str(error).split())
    return f" ({type(error).__name__}: {text})" if text else ""


def resolve_dataset(config) -> str:
    """The data directory: `config.data.path`, or the embedded stdlib corpus (prepared once)."""
    path = config.data.path
    if path:
        if os.path.isfile(path):
            parent = os.path.dirname(os.path.abspath(path))
            which = parent if prepare_lib.is_dataset_dir(parent) else "the directory"
            raise ConfigError(f"data.path={path} is a file, not a directory: point it at {which} "
                              "scripts/prepare_data.py wrote (its --output).")
        if not os.path.isdir(path):
            raise MissingFileError(f"data.path={path} does not exist.")
        # A missing or corrupt file fails here, with the file named, before anything else starts
        # (not inside a worker, and not while a checkpoint is being restored); so does a count in
        # metadata.json that its files do not hold.
        meta = load_metadata(path)
        for split in prepare_lib.SPLITS:
            for entry in (meta["splits"].get(split) or {}).get("files", []):
                check_shard(os.path.join(path, entry["path"]), entry["num_documents"])
        shard_counts.check_counts(path, meta)
        return path
    cache = config.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "longctx")
    try:
        if os.path.exists(cache) and not os.path.isdir(cache):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), cache)
        return prepare_lib.prepare_stdlib(cache)
    except OSError as e:  # a file in the way, no permission, a full disk
        raise ConfigError(f"data.cache_dir={cache} cannot hold the prepared embedded corpus "
                          f"({errors.os_reason(e)}); point it at a writable directory.") from None


def load_metadata(data_dir: str) -> dict:
    path = os.path.join(data_dir, prepare_lib.METADATA)
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} does not exist; prepare the data with scripts/prepare_data.py.")
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg}).") from None
    for key in _REQUIRED_META:
        if key not in meta:
            raise ConfigError(f"{path} has no key {key!r}.")
    return meta


def check_shard(path: str, num_documents: int) -> None:
    """ConfigError unless `path` is a readable ArrayRecord file of `num_documents` records."""
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} is listed in metadata.json but does not exist.")
    st = os.stat(path)
    n = _num_records(path, st.st_size, st.st_mtime_ns)
    if n != num_documents:
        raise ConfigError(f"{path} is corrupt: it holds {n} records but metadata.json lists "
                          f"{num_documents}; {_REDO}")


@functools.lru_cache(maxsize=4096)
def _num_records(path: str, size: int, mtime_ns: int) -> int:
    """Records in an ArrayRecord file (its footer is read once per version of the file)."""
    from array_record.python.array_record_module import ArrayRecordReader  # lazily, like grain (above)

    del size, mtime_ns  # the cache key: a rewritten file is read again
    try:
        reader = ArrayRecordReader(path)
        n = reader.num_records()
        reader.close()
    except Exception as e:  # noqa: BLE001  (the reader raises assorted status errors)
        raise ConfigError(f"{path} is corrupt: not a readable ArrayRecord file{_reason(e)}; "
                          f"{_REDO}") from None
    return n


def check_splits(config, meta: dict, data_dir: str, mesh) -> None:
    """ConfigError, at start-up (before anything compiles), for a dataset the run would fail on
    later: a train split with fewer documents than the data shards that read it, or, when the
    run evaluates (train.eval_every > 0), such a validation split (prepare_data warns about both;
    without this check the run trained eval_every steps and stopped with no checkpoint)."""
    count = sharding_lib.data_shard(mesh, config.data.global_batch_size, config.data.seq_len).count

    def too_few(split: str) -> str | None:
        n = int((meta["splits"].get(split) or {}).get("num_documents") or 0)
        if n == 0:
            return f"no {split} documents"
        if n < count:
            return f"{n} {split} documents, fewer than the {count} data shards that read them"
        return None

    few = too_few("train")
    if few:
        raise ConfigError(f"{data_dir} has {few}: prepare it again with a smaller --val-fraction or "
                          "from more documents.")
    few = too_few("validation")
    if few and config.train.eval_every:
        raise ConfigError(f"{data_dir} has {few}, and train.eval_every={config.train.eval_every} "
                          "evaluates on them: set --config.train.eval_every=0, or prepare the data "
                          "again with --val-fraction above 0 from more documents.")


class TokenSource(grain.sources.RandomAccessDataSource):
    """One split's documents as int32 arrays; checks each file and each record it reads."""

    def __init__(self, data_dir: str, split: str, meta: dict):
        info = meta["splits"].get(split)
        if not info or not info["files"]:
            raise ConfigError(f"{data_dir} has no {split!r} documents (metadata.json splits.{split}).")
        self._paths, counts = [], []
        for entry in info["files"]:
            p = os.path.join(data_dir, entry["path"])
            check_shard(p, entry["num_documents"])
            self._paths.append(p)
            counts.append(entry["num_documents"])
        self._starts = np.cumsum([0] + counts).tolist()
        self._vocab = int(meta["vocab_size"])
        self._src = grain.sources.ArrayRecordDataSource(self._paths)

    def __len__(self) -> int:
        return self._starts[-1]

    def _where(self, index: int) -> str:
        f = bisect.bisect_right(self._starts, index) - 1
        return f"{self._paths[f]} record {index - self._starts[f]}"

    def __getitem__(self, index: int) -> np.ndarray:
        try:
            record = self._src[index]
        except Exception as e:  # noqa: BLE001  (assorted status errors from the reader)
            raise ConfigError(f"{self._where(index)} is corrupt{_reason(e)}; {_REDO}") from None
        if len(record) % 4 or len(record) < 8:
            raise ConfigError(f"{self._where(index)} is corrupt: {len(record)} bytes is not a "
                              f"document of int32 ids; {_REDO}")
        ids = np.frombuffer(record, dtype="<i4")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self._vocab:
            raise ConfigError(f"{self._where(index)} has token id {hi if hi >= self._vocab else lo} "
                              f"outside the vocabulary [0, {self._vocab}).")
        return ids

    def __repr__(self) -> str:
        return f"TokenSource({len(self)} documents in {len(self._paths)} files)"


class SelectedDocuments(grain.sources.RandomAccessDataSource):
    """Some of a TokenSource's documents, by index (an index listed twice is read twice)."""

    def __init__(self, source: TokenSource, indices: np.ndarray):
        self._source, self._indices = source, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> np.ndarray:
        return self._source[int(self._indices[index])]

    def __repr__(self) -> str:
        return f"SelectedDocuments({len(self)} of {self._source!r})"


def packed_rows(data_dir: str, split: str, *, seq_len: int, packer: str, seed: int,
                shard_index: int = 0, shard_count: int = 1, num_epochs: int | None = None,
                shuffle: bool = True, batch_size: int = 1, read_threads: int = 8,
                num_bins: int | None = None, meta: dict | None = None, num_shards: int = 1,
                block_size: int = 512, documents: np.ndarray | None = None,
                pairs_per_epoch: int | None = None) -> grain.IterDataset:
    """Packed rows (dicts of `[seq_len]` int32, natural order) for one data shard.

    `num_bins` overrides the first/best-fit bin count (default: `packing.num_packing_bins`).
    `num_shards` (sp) and `block_size` (the ring's) matter to shard_balanced only. `documents`:
    the split's documents one epoch reads, by index, a document listed k times read k times
    (mixture.py's length filters and upsampling; default: each once), with `pairs_per_epoch`
    their (input, target) pairs per data shard.
    """
    meta = meta or load_metadata(data_dir)
    split = _SPLIT_NAMES.get(split, split)
    if split not in prepare_lib.SPLITS:
        raise ConfigError(f"split={split!r} must be 'train' or 'validation'.")
    if seq_len <= 0:
        raise ConfigError(f"data.seq_len={seq_len} must be positive.")
    source = TokenSource(data_dir, split, meta)
    if documents is not None:
        source = SelectedDocuments(source, documents)
    if not 0 <= shard_index < shard_count:
        raise ConfigError(f"data shard {shard_index} is out of range for {shard_count} shards.")
    if len(source) < shard_count:
        raise ConfigError(f"{data_dir} has {len(source)} {split} documents, fewer than the "
                          f"{shard_count} data shards that read it.")
    seed = int(seed) % 2**32
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)  # a different permutation every epoch (seed + epoch)
    ds = ds.repeat(num_epochs)
    # Strided over the (repeated) global order: shards are disjoint, together cover each epoch,
    # and a shard only ever touches the records it keeps.
    ds = ds[shard_index::shard_count]
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64))
    return pack_documents(it, seq_len=seq_len, packer=packer, seed=seed, pad_id=int(meta["pad_id"]),
                          batch_size=batch_size, num_bins=num_bins,
                          pairs_per_epoch=(pairs_per_shard_epoch(meta, split, shard_count)
                                           if documents is None else pairs_per_epoch),
                          num_shards=num_shards, block_size=block_size)


def pack_documents(documents: grain.IterDataset, *, seq_len: int, packer: str, seed: int,
                   pad_id: int, batch_size: int = 1, num_bins: int | None = None,
                   pairs_per_epoch: int | None = None, num_shards: int = 1,
                   block_size: int = 512) -> grain.IterDataset:
    """Documents (int32 token ids, BOS ... EOS) -> packed rows: split, packed, five features."""
    it = gx.FlatMapIterDataset(documents, packing.SplitDocument(seq_len))
    it = packing.pack(it, packer, seq_len, batch_size=batch_size, pad_id=pad_id, seed=seed,
                      num_bins=num_bins, pairs_per_epoch=pairs_per_epoch, num_shards=num_shards,
                      block_size=block_size)
    return it.map(packing.RowFeatures(pad_id))


def pairs_per_shard_epoch(meta: dict, split: str, shard_count: int) -> int | None:
    """(input, target) pairs in one epoch of one data shard (a document of n tokens has n - 1),
    on average; None when metadata.json does not count the split's tokens."""
    info = meta["splits"][split]
    if info.get("num_tokens") is None or info.get("num_documents") is None:
        return None
    return -(-(int(info["num_tokens"]) - int(info["num_documents"])) // shard_count)


@functools.lru_cache(maxsize=16)
def layout_permutation(layout: str, seq_len: int, num_shards: int) -> np.ndarray | None:
    """`longctx.parallel.layout.permutation`, or None when it is the identity (nothing to move)."""
    perm = np.asarray(layout_lib.permutation(layout, seq_len, num_shards))
    return None if np.array_equal(perm, np.arange(seq_len)) else perm


def layout_block(config) -> int:
    """The block a per-row layout aligns documents to: the largest of the run's attention blocks
    (every layer type's; the smaller ones divide it)."""
    a = config.attention
    blocks = [a.block_size] + [t.get("block_size") for t in (a.get("layer_types") or {}).values()]
    return max(int(b) for b in blocks if b is not None)


def layout_transform(layout: str, seq_len: int, num_shards: int, block: int) -> grain.transforms.Map:
    """What puts a batch of natural-order rows into the sp layout: one permutation for every row
    (PermuteLayout, nothing for the identity), or each row's own (the per-document layout)."""
    if layout_lib.per_row(layout):
        return packing.PermuteEachRow(num_shards, block)
    return packing.PermuteLayout(layout_permutation(layout, seq_len, num_shards))


def batched(rows: grain.IterDataset, batch_size: int, layout: grain.transforms.Map, *,
            num_workers: int = 0, prefetch_buffer_size: int = 2) -> grain.IterDataset:
    ds = rows.batch(batch_size, drop_remainder=True).map(layout)
    if num_workers > 0:
        # Grain's workers read absl flags; outside an absl app (pytest, notebooks) they are
        # unparsed and reading one raises, so accept the defaults.
        from absl import flags  # lazily: only with worker processes

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        # Each worker packs its own slice of the documents; the output is deterministic for a
        # given num_workers (and a checkpoint must be restored with the same num_workers).
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=num_workers, per_worker_buffer_size=max(1, prefetch_buffer_size)))
    elif prefetch_buffer_size > 0:
        ds = gx.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch_buffer_size)
    return ds


def dataset_fingerprint(data_dir: str, meta: dict, split: str = "train") -> dict:
    """What identifies one split's documents, cheaply: the tokenizer, the split's document and
    token counts, and each file's name, counts and size in bytes. A dataset prepared again from
    the same input is byte-identical, so it has the same fingerprint; another corpus (or another
    tokenizer) written at the same path has another."""
    info = meta["splits"].get(split) or {}
    files = []
    for entry in info.get("files", []):
        path = os.path.join(data_dir, entry["path"])
        files.append({"path": entry["path"], "num_documents": entry["num_documents"],
                      "num_tokens": entry.get("num_tokens"),
                      "bytes": os.path.getsize(path) if os.path.isfile(path) else None})
    return {"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"],
            "pad_id": meta["pad_id"], "split": split,
            "num_documents": info.get("num_documents"), "num_tokens": info.get("num_tokens"),
            "files": files}


class BatchIterator:
    """Yields dicts of global `jax.Array`s `[global_batch, seq_len]` (see packing.KEYS)."""

    def __init__(self, ds: grain.IterDataset, mesh, shard: sharding_lib.DataShard,
                 global_batch_size: int, seq_len: int, metadata: dict, fingerprint: dict | None = None,
                 packing_settings: dict | None = None, seed_offset: int = 0,
                 sources: dict | None = None):
        self.grain_iterator = iter(ds)
        self.mesh, self.shard, self.metadata = mesh, shard, metadata
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self.fingerprint, self.packing_settings = fingerprint, packing_settings
        self.seed_offset = seed_offset
        self.sources = sources  # a mixture's {name: what its state means} (mixture.source_rows)

    def stream_record(self) -> dict:
        """What this iterator's saved state means beyond the config, the same on every process:
        each process's data shard (`{"0": {"index", "count", "rows": [start, stop]}, ...}`;
        processes of one sp group share one), the dataset's fingerprint, the values of the keys
        the packer's rows depend on (`packing.row_settings`) and the seed offset the stream was
        made with (a restarted stream's step). A state restored under another map would have the
        processes of one sp group feed different rows into one sequence; under other packing
        settings it would re-pack its window into other rows; under another seed it would stand at
        the same place in another order of the documents. A mixture records these per source
        (`sources`: weight, dataset, packing, selection, seed and their id) instead."""
        shards = sharding_lib.data_shards(self.mesh, self.global_batch_size, self.seq_len)
        record = {"shards": {str(p): {"index": s.index, "count": s.count,
                                      "rows": [s.row_start, s.row_stop]} for p, s in shards.items()},
                  "dataset": self.fingerprint, "packing": self.packing_settings,
                  "seed_offset": self.seed_offset}
        if self.sources is not None:
            record["sources"] = self.sources
        return record

    def __iter__(self):
        return self

    def next_local(self) -> dict[str, np.ndarray]:
        """This process's rows `[local_batch, seq_len]` as numpy, already in the sp layout."""
        return next(self.grain_iterator)

    def __next__(self):
        return self.next_with_local()[0]

    def next_with_local(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(the global batch, this process's rows of it as numpy): what the host counts of a batch
        (MFU's attention pairs) it reads from its own copy, not back from the devices."""
        local = self.next_local()
        return sharding_lib.make_global_batch(local, self.mesh, self.global_batch_size, self.seq_len), local

    def get_state(self) -> dict:
        return self.grain_iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.grain_iterator.set_state(state)

    def close(self) -> None:
        """Stops Grain's worker processes / prefetch thread (else they go at garbage collection)."""
        close = getattr(self.grain_iterator, "close", None)
        if close is not None:
            close()


LAYOUT_SAMPLE_ROWS = 8


def layout_sample(config, data_dir: str, rows: int = LAYOUT_SAMPLE_ROWS, *, num_shards: int = 1,
                  block_size: int = 512) -> np.ndarray:
    """Segment ids [rows, seq_len] (natural order, 0 = padding) of the first packed rows of the
    train split in its shuffled order: the documents attention.layout='auto' is chosen on. The
    same rows on every process and at every start of the run (data shard 0 of 1, the run's
    shuffle seed and packer), so every host picks the same layout and a resumed run the one it
    started with. `num_shards` (sp) and `block_size` as packed_rows' (shard_balanced's only)."""
    d = config.data
    it = iter(packed_rows(data_dir, "train", seq_len=d.seq_len, packer=d.packer,
                          seed=d.shuffle_seed, num_shards=num_shards, block_size=block_size))
    try:
        return np.stack([next(it)["segment_ids"] for _ in range(rows)])
    finally:
        close = getattr(it, "close", None)  # its read threads, else they go at garbage collection
        if close is not None:
            close()


class PackedSample:
    """layout_sample's rows as a run of each sp and block packs them: `sample(sp, block)` ->
    segment ids [rows, seq_len], packed once per distinct setting of what data.packer's rows
    depend on (packing.Packer.row_keys): shard_balanced's rows follow the sp and the block (it
    balances documents over the sp shards by their work in blocks); a packer that ignores both
    (first/best fit, concat-then-split) packs once for every (sp, block). The rest is
    layout_sample's for all: data shard 0 of 1, its bins (scripts/plan.py prices every candidate
    on it)."""

    def __init__(self, config, data_dir: str, rows: int = LAYOUT_SAMPLE_ROWS):
        self.config, self.data_dir, self.rows = config, data_dir, rows
        self._packed: dict[tuple, np.ndarray] = {}

    def setting(self, sp: int, block: int) -> tuple:
        """What of (sp, block) the packer's rows depend on: the cache key."""
        settings = packing.row_settings(self.config.data.packer, seq_len=self.config.data.seq_len,
                                        num_shards=sp, block_size=block, bins=None)
        return tuple(sorted(settings.items()))

    def __call__(self, sp: int, block: int) -> np.ndarray:
        key = self.setting(sp, block)
        if key not in self._packed:
            self._packed[key] = layout_sample(self.config, self.data_dir, self.rows,
                                              num_shards=sp, block_size=block)
            self._packed[key].setflags(write=False)
        return self._packed[key]

    @property
    def packings(self) -> int:
        """Distinct packings made so far."""
        return len(self._packed)


def make_batch_iterator(config, mesh, *, split: str = "train", layout: str, data_dir: str,
                        seed_offset: int = 0, num_epochs: int | None = None) -> BatchIterator:
    """The iterator the train loop consumes; `layout` is a concrete layout name (not "auto").

    The config is `config.validate`d (packer, seq_len against sp) and the tokenizer checked
    against model.vocab_size by the trainer before this is called; this checks only the data."""
    d = config.data
    meta = load_metadata(data_dir)
    if layout == "auto":
        raise ValueError("make_batch_iterator needs a concrete layout; resolve attention.layout='auto' first.")
    sp = mesh.shape["sp"]
    shard = sharding_lib.data_shard(mesh, d.global_batch_size, d.seq_len)
    split = _SPLIT_NAMES.get(split, split)
    train = split == "train"
    seed = (d.shuffle_seed + seed_offset) if train else 0
    # Validation packs into few bins, so the first batches hold the first documents of the
    # split (not bins filled from many repeats of a small split), and runs in-process: an eval
    # builds a fresh iterator each time, and starting worker processes would cost more than the
    # few batches it reads.
    num_bins = None if train else max(8, shard.local_batch_size)
    rows = packed_rows(data_dir, split, seq_len=d.seq_len, packer=d.packer, seed=seed,
                       shard_index=shard.index, shard_count=shard.count, num_epochs=num_epochs,
                       shuffle=train, batch_size=shard.local_batch_size, num_bins=num_bins, meta=meta,
                       num_shards=sp, block_size=config.attention.block_size)
    ds = batched(rows, shard.local_batch_size, layout_transform(layout, d.seq_len, sp, layout_block(config)),
                 num_workers=d.num_workers if train else 0,
                 prefetch_buffer_size=d.prefetch_buffer_size)
    # What packed_rows packed with (it has checked the split and seq_len that the bins divide by).
    bins = packing.bins_for(d.packer, d.seq_len, shard.local_batch_size, num_bins,
                            pairs_per_shard_epoch(meta, split, shard.count))
    settings = packing.row_settings(d.packer, seq_len=d.seq_len, num_shards=sp,
                                    block_size=config.attention.block_size, bins=bins)
    return BatchIterator(ds, mesh, shard, d.global_batch_size, d.seq_len, meta,
                         dataset_fingerprint(data_dir, meta, split), settings,
                         seed_offset if train else 0)
