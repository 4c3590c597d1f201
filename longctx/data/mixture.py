"""Data mixtures: named sources, each a prepared directory, mixed by tokens.

`data.sources` names the sources (`data.path` stays the one-source form):

    data.sources.code  = {"path": "data/code",  "weight": 0.6, "upsample_factor": 3, "upsample_above": 32768}
    data.sources.short = {"path": "data/short", "weight": 0.4, "max_length": 8192}

A path is a directory scripts/prepare_data.py wrote, or `embedded:files` / `embedded:packages`
(the standard library one file, or one top-level package, per document; prepared once under
data.cache_dir). Weights are any positive numbers, normalized to sum to 1. Per source, before its
shuffle: documents shorter than `min_length` or longer than `max_length` tokens (0: no bound) are
left out, and each document of at least `upsample_above` tokens is read `upsample_factor` times
per epoch (a fraction by a fixed draw per document), as Fu et al. 2024 upsample long documents
within each source while keeping the mix of sources. The lengths come from the shards' chunk
headers (shard_counts.document_lengths), not from reading the documents.

How weights become token shares. Each source is packed on its own (its own shuffle, data shard
and packer, exactly as a one-source run packs it), and the mixer takes whole packed rows: next
from the source furthest below its share, the one whose real tokens so far over its weight is
smallest. So a row holds one source's documents (ProLong packs by source too), and after any n
rows every source's share of the real tokens is within one row's tokens of its weight: over the
first 200 rows, within 0.5 points. Grain's own `mix` weighs elements (rows), not tokens, so a
source that packs with more padding would get fewer tokens than its weight; and its state is one
position in one interleaving, which a weight change would move for every source.

State (`get_state`, saved with the checkpoint): each source's own iterator state, tagged with an
id of what that state means (its dataset fingerprint, packing settings, filters and seed), and the
mixer's token counts with the weights they were counted under. A resume restores each source
whose id is unchanged where it was; a source that is new, or whose data, packing or filters
changed, starts at its beginning; a source no longer listed is dropped. The mixer's counts carry
over when the weights and the sources are unchanged and otherwise start from zero at the new
weights (the new shares hold from the resume on; past tokens are not compensated). The resume
line says what changed (checkpoint_compat.mixture_notice).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib

import grain
import numpy as np

from longctx.data import packing
from longctx.data import pipeline
from longctx.data import prepare as prepare_lib
from longctx.data import shard_counts
from longctx.data import sharding as sharding_lib
from longctx.errors import ConfigError, MissingFileError

# The keys one source may set, with their defaults.
SOURCE_DEFAULTS = {"path": "", "weight": 1.0, "min_length": 0, "max_length": 0,
                   "upsample_factor": 1.0, "upsample_above": 0}
EMBEDDED_FILES, EMBEDDED_PACKAGES = "embedded:files", "embedded:packages"
REPORT_ROWS = 200  # rows over which the achieved shares are measured at start-up
_TOKENIZER_KEYS = ("tokenizer", "vocab_size", "bos_id", "eos_id", "pad_id")


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float  # normalized: the weights of a mixture sum to 1
    min_length: int = 0
    max_length: int = 0
    upsample_factor: float = 1.0
    upsample_above: int = 0

    @property
    def selects(self) -> bool:
        """Whether the source reads other than each train document once per epoch."""
        return bool(self.min_length or self.max_length or self.upsample_factor != 1.0)

    def selection(self) -> dict:
        return {k: getattr(self, k) for k in ("min_length", "max_length", "upsample_factor",
                                               "upsample_above")}


def sources(config) -> list[Source]:
    """The mixture's sources, by name; [] for a one-source run (data.path). The config has been
    validated (config.validate_sources)."""
    given = config.data.get("sources") or {}
    if not given:
        return []
    raw = {name: {**SOURCE_DEFAULTS, **dict(given[name])} for name in sorted(given)}
    total = sum(float(s["weight"]) for s in raw.values())
    return [Source(name, str(s["path"]), float(s["weight"]) / total, int(s["min_length"]),
                   int(s["max_length"]), float(s["upsample_factor"]), int(s["upsample_above"]))
            for name, s in raw.items()]


def _cache_dir(config) -> str:
    return config.data.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "longctx")


def source_dir(config, source: Source, *, prepare: bool = True) -> str | None:
    """The prepared directory of one source, its files checked (pipeline.resolve_dataset); the
    embedded ones are prepared on first use, or with `prepare=False` are None until they are."""
    if source.path in (EMBEDDED_FILES, EMBEDDED_PACKAGES) and not prepare:
        where = (prepare_lib.stdlib_dir if source.path == EMBEDDED_FILES else prepare_lib.stdlib_packages_dir)
        if not os.path.isfile(os.path.join(where(_cache_dir(config)), prepare_lib.METADATA)):
            return None
    if source.path == EMBEDDED_PACKAGES:
        return prepare_lib.prepare_stdlib_packages(_cache_dir(config))
    key, path = f"data.sources.{source.name}.path={source.path}", source.path
    prepare_it = f"prepare it with scripts/prepare_data.py --output {path} (docs/data.md, \"Mixtures\")"
    if source.path != EMBEDDED_FILES:
        if os.path.isfile(path):
            raise ConfigError(f"{key} is a file, not a directory: point it at the directory "
                              "scripts/prepare_data.py wrote (its --output).")
        if not os.path.isdir(path):
            raise MissingFileError(f"{key} does not exist: {prepare_it}.")
        if not os.path.isfile(os.path.join(path, prepare_lib.METADATA)):
            # A directory of other files (docs/) is no place to write a dataset into.
            fix = (prepare_it if not os.listdir(path) else "point it at a directory scripts/prepare_data.py "
                   "wrote (its --output), or prepare one into a new directory (docs/data.md, \"Mixtures\")")
            raise MissingFileError(f"{key} holds no {prepare_lib.METADATA}, so it is not a prepared "
                                   f"dataset: {fix}.")
    one = config.copy_and_resolve_references()
    one.data.path = "" if source.path == EMBEDDED_FILES else source.path
    try:
        return pipeline.resolve_dataset(one)
    except ConfigError as e:
        raise type(e)(f"data.sources.{source.name}: {e}") from None


def source_dirs(config) -> dict[str, str]:
    """`{name: prepared directory}`; ConfigError unless every source has the same tokenizer."""
    dirs = {s.name: source_dir(config, s) for s in sources(config)}
    _check_one_tokenizer(dirs)
    return dirs


def _check_one_tokenizer(dirs: dict[str, str]) -> None:
    first = None
    for name, d in dirs.items():
        meta = pipeline.load_metadata(d)
        ids = {k: meta[k] for k in _TOKENIZER_KEYS}
        if first is None:
            first = (name, ids)
        elif ids != first[1]:
            key = next(k for k in _TOKENIZER_KEYS if ids[k] != first[1][k])
            raise ConfigError(f"data.sources.{name} ({d}) has {key}={ids[key]!r} and data.sources."
                              f"{first[0]} has {first[1][key]!r}: every source of a mixture must be "
                              f"prepared with the same tokenizer, so prepare {name} again with "
                              f"--tokenizer {first[1]['tokenizer']}.")


def check_sources(config, mesh) -> tuple[str | None, str]:
    """`--validate_only`'s check of a mixture, writing nothing: every source's directory exists
    and is a whole prepared dataset, all share one tokenizer, each keeps train documents for
    every data shard after its filters and (when the run evaluates) has validation documents;
    an embedded source not prepared yet is left to its first use. ConfigError, one sentence
    naming the source, for the first that fails. Returns a prepared directory whose metadata
    stands for all (None when none is prepared yet) and what was checked, in words."""
    dirs, names = {}, []
    for source in sources(config):
        d = source_dir(config, source, prepare=False)
        names.append(source.name if d else f"{source.name} (embedded, prepared on first use)")
        if d is None:
            continue
        dirs[source.name] = d
        meta = pipeline.load_metadata(d)
        try:
            pipeline.check_splits(config, meta, d, mesh)
        except ConfigError as e:
            raise ConfigError(f"data.sources.{source.name}: {e}") from None
        if source.selects:
            count = sharding_lib.data_shard(mesh, config.data.global_batch_size, config.data.seq_len).count
            _selected(source, d, meta, count)
    _check_one_tokenizer(dirs)
    return next(iter(dirs.values()), None), f"data sources {', '.join(names)}"


def resolve_dataset(config) -> str:
    """pipeline.resolve_dataset, or for a mixture every source checked and the first's directory
    (its metadata stands for all: they share one tokenizer)."""
    if not sources(config):
        return pipeline.resolve_dataset(config)
    return next(iter(source_dirs(config).values()))


def check_splits(config, meta: dict, data_dir: str, mesh) -> None:
    """pipeline.check_splits, for each source of a mixture."""
    if not sources(config):
        return pipeline.check_splits(config, meta, data_dir, mesh)
    for name, d in source_dirs(config).items():
        try:
            pipeline.check_splits(config, pipeline.load_metadata(d), d, mesh)
        except ConfigError as e:
            raise ConfigError(f"data.sources.{name}: {e}") from None


def source_seed(config, name: str, seed_offset: int) -> int:
    """A source's shuffle seed: data.shuffle_seed + the offset, moved by its name (not its
    position, so adding a source leaves the others' orders alone)."""
    return (config.data.shuffle_seed + seed_offset + zlib.crc32(name.encode())) % 2**32


def split_lengths(data_dir: str, meta: dict, split: str = "train") -> np.ndarray:
    """The token count of every document of a split, in index order."""
    out = []
    for entry in meta["splits"][split]["files"]:
        path = os.path.join(data_dir, entry["path"])
        lengths = shard_counts.document_lengths(path, entry["num_documents"])
        if lengths is None:  # several documents per chunk: read them
            reader = grain.sources.ArrayRecordDataSource([path])
            lengths = np.array([len(reader[i]) // 4 for i in range(len(reader))], np.int64)
        out.append(lengths)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def selected_documents(source: Source, lengths: np.ndarray) -> np.ndarray:
    """The documents one epoch of `source` reads, by index (long ones repeated)."""
    keep = lengths >= source.min_length
    if source.max_length:
        keep &= lengths <= source.max_length
    if not keep.any():
        raise ConfigError(f"data.sources.{source.name}: no train document has {source.min_length} to "
                          f"{source.max_length or 'any number of'} tokens (they have "
                          f"{int(lengths.min())} to {int(lengths.max())}): widen min_length/max_length.")
    copies = np.ones(len(lengths), np.int64)
    long = lengths >= source.upsample_above
    whole, part = divmod(source.upsample_factor, 1.0)
    draw = np.random.default_rng(zlib.crc32(source.name.encode())).random(len(lengths))
    copies[long] = int(whole) + (draw[long] < part)
    index = np.arange(len(lengths))[keep]
    return np.repeat(index, copies[keep])


def _selected(source: Source, data_dir: str, meta: dict, shard_count: int) -> tuple[np.ndarray, int]:
    """The documents one epoch of a filtering or upsampling source reads, and their (input,
    target) pairs per data shard; ConfigError when they are fewer than the data shards."""
    lengths = split_lengths(data_dir, meta)
    documents = selected_documents(source, lengths)
    if len(documents) < shard_count:
        raise ConfigError(f"data.sources.{source.name}: its filters keep {len(documents)} train "
                          f"documents, fewer than the {shard_count} data shards that read them: "
                          "widen its min_length/max_length.")
    return documents, -(-int((lengths[documents] - 1).sum()) // shard_count)


@dataclasses.dataclass(frozen=True)
class SourceRows:
    """One source's packed rows for one data shard, and what its iterator state means."""
    rows: grain.IterDataset
    record: dict  # weight, dataset fingerprint, packing settings, selection, id


def source_rows(config, source: Source, data_dir: str, *, shard: sharding_lib.DataShard, sp: int,
                seed_offset: int = 0) -> SourceRows:
    d = config.data
    meta = pipeline.load_metadata(data_dir)
    seed = source_seed(config, source.name, seed_offset)
    documents = pairs = None
    if source.selects:
        documents, pairs = _selected(source, data_dir, meta, shard.count)
    else:
        pairs = pipeline.pairs_per_shard_epoch(meta, "train", shard.count)
    rows = pipeline.packed_rows(data_dir, "train", seq_len=d.seq_len, packer=d.packer, seed=seed,
                                shard_index=shard.index, shard_count=shard.count,
                                batch_size=shard.local_batch_size, meta=meta, num_shards=sp,
                                block_size=config.attention.block_size, documents=documents,
                                pairs_per_epoch=pairs)
    bins = packing.bins_for(d.packer, d.seq_len, shard.local_batch_size, None, pairs)
    settings = packing.row_settings(d.packer, seq_len=d.seq_len, num_shards=sp,
                                    block_size=config.attention.block_size, bins=bins)
    record = {"dataset": pipeline.dataset_fingerprint(data_dir, meta), "packing": settings,
              "selection": source.selection(), "seed": seed}
    # the id: what the source's own state means (its weight is the mixer's business)
    record["id"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return SourceRows(rows, {"weight": source.weight, **record})


class MixtureIterDataset(grain.IterDataset):
    """Packed rows of several sources, mixed by real tokens (see the module docstring)."""

    def __init__(self, parents: dict[str, grain.IterDataset], weights: dict[str, float],
                 ids: dict[str, str]):
        self._names = sorted(parents)
        super().__init__([parents[n] for n in self._names])
        self._weights = {n: float(weights[n]) for n in self._names}
        self._ids = {n: ids[n] for n in self._names}

    def __iter__(self):
        return MixtureIterator([p.__iter__() for p in self._parents], self._names, self._weights,
                               self._ids)

    def __str__(self) -> str:
        return f"MixtureIterDataset({self._weights})"


class MixtureIterator(grain.DatasetIterator):
    """Takes the next row from the source furthest below its token share."""

    def __init__(self, parents, names, weights, ids):
        super().__init__(parents)
        self._names, self._weights, self._ids = names, weights, ids
        self._initial = [p.get_state() for p in parents]  # what a source that starts over gets
        self._tokens = [0] * len(names)

    def __next__(self):
        i = min(range(len(self._names)), key=lambda k: (self._tokens[k] / self._weights[self._names[k]], k))
        row = next(self._parents[i])
        self._tokens[i] += int(np.sum(row["loss_mask"]))
        return row

    @property
    def tokens(self) -> dict[str, int]:
        """Real tokens taken from each source so far (since the counts last started)."""
        return dict(zip(self._names, self._tokens))

    def get_state(self) -> dict:
        return {"weights": dict(self._weights), "tokens": self.tokens,
                "sources": {n: {"id": self._ids[n], "state": p.get_state()}
                            for n, p in zip(self._names, self._parents)}}

    def set_state(self, state: dict) -> None:
        saved = state.get("sources") or {}
        for name, parent, initial in zip(self._names, self._parents, self._initial):
            kept = saved.get(name)
            parent.set_state(kept["state"] if kept and kept.get("id") == self._ids[name] else initial)
        same = (state.get("weights") == self._weights
                and all((saved.get(n) or {}).get("id") == self._ids[n] for n in self._names))
        counts = state.get("tokens") or {}
        self._tokens = [int(counts.get(n, 0)) if same else 0 for n in self._names]


def mixture_rows(config, source_dir_of: dict[str, str], *, shard: sharding_lib.DataShard, sp: int,
                 seed_offset: int = 0) -> tuple[MixtureIterDataset, dict]:
    """The mixture's rows for one data shard, and `{name: record}` (what each state means)."""
    built = {s.name: source_rows(config, s, source_dir_of[s.name], shard=shard, sp=sp,
                                 seed_offset=seed_offset) for s in sources(config)}
    mixed = MixtureIterDataset({n: b.rows for n, b in built.items()},
                               {n: b.record["weight"] for n, b in built.items()},
                               {n: b.record["id"] for n, b in built.items()})
    return mixed, {n: b.record for n, b in built.items()}


def achieved_shares(config, sp: int = 1, rows: int = REPORT_ROWS, seed_offset: int = 0) -> dict:
    """`{name: {"weight", "share"}}`: each source's share of the real tokens of the first `rows`
    rows of the stream data shard 0 of 1 reads (the run's packer; `sp`: the mesh's)."""
    dirs = source_dirs(config)
    shard = sharding_lib.DataShard(0, 1, 0, 1)
    mixed, records = mixture_rows(config, dirs, shard=shard, sp=sp, seed_offset=seed_offset)
    it = iter(mixed)
    try:
        for _ in range(rows):
            next(it)
        tokens = it.tokens
    finally:
        close_iterator(it)
    total = max(1, sum(tokens.values()))
    return {n: {"weight": round(records[n]["weight"], 6), "share": round(tokens[n] / total, 6)}
            for n in tokens}


def close_iterator(iterator) -> None:
    close = getattr(iterator, "close", None)  # read threads, else they go at garbage collection
    if close is not None:
        close()


def describe_data(config, data_dir: str) -> str:
    """What the start-up line calls the run's data: 'data DIR', or for a mixture its sources (the
    first's directory, `resolve_dataset`'s, stands for their metadata only)."""
    names = [s.name for s in sources(config)]
    if not names:
        return f"data {data_dir}"
    return f"data mixture of {len(names)} sources ({', '.join(names)}: data.sources)"


def describe_shares(shares: dict, rows: int = REPORT_ROWS) -> str:
    """'data mixture by tokens over the first 200 rows: code 60.0% (weight 60.0%), ...'."""
    parts = [f"{n} {s['share']:.1%} (weight {s['weight']:.1%})" for n, s in shares.items()]
    return f"data mixture by tokens over the first {rows} rows: " + ", ".join(parts)


def validation_sources(config) -> list[str | None]:
    """The sources evaluated apart (each its own validation split), [None] for a one-source run."""
    return [s.name for s in sources(config)] or [None]


def layout_sample(config, data_dir: str, rows: int = pipeline.LAYOUT_SAMPLE_ROWS) -> np.ndarray:
    """pipeline.layout_sample, or for a mixture the first rows of the mixture (data shard 0 of 1)."""
    if not sources(config):
        return pipeline.layout_sample(config, data_dir, rows)
    mixed, _ = mixture_rows(config, source_dirs(config), shard=sharding_lib.DataShard(0, 1, 0, 1), sp=1)
    it = iter(mixed)
    try:
        return np.stack([next(it)["segment_ids"] for _ in range(rows)])
    finally:
        close_iterator(it)


def make_batch_iterator(config, mesh, *, split: str = "train", layout: str, data_dir: str,
                        seed_offset: int = 0, num_epochs: int | None = None,
                        source: str | None = None) -> pipeline.BatchIterator:
    """pipeline.make_batch_iterator, or for a mixture: its train stream (every source's data
    shard, mixed), or one `source`'s validation split (evaluated apart)."""
    if not sources(config):
        if source is not None:
            raise ValueError(f"source={source!r} given, but the config has no data.sources.")
        return pipeline.make_batch_iterator(config, mesh, split=split, layout=layout, data_dir=data_dir,
                                            seed_offset=seed_offset, num_epochs=num_epochs)
    dirs = source_dirs(config)
    if split != "train":
        if source not in dirs:
            raise ValueError(f"a mixture's {split} split is read per source: name one of {sorted(dirs)}.")
        return pipeline.make_batch_iterator(config, mesh, split=split, layout=layout,
                                            data_dir=dirs[source], num_epochs=num_epochs)
    if layout == "auto":
        raise ValueError("make_batch_iterator needs a concrete layout; resolve attention.layout='auto' first.")
    d = config.data
    sp = mesh.shape["sp"]
    shard = sharding_lib.data_shard(mesh, d.global_batch_size, d.seq_len)
    rows, records = mixture_rows(config, dirs, shard=shard, sp=sp, seed_offset=seed_offset)
    ds = pipeline.batched(rows, shard.local_batch_size,
                          pipeline.layout_transform(layout, d.seq_len, sp, pipeline.layout_block(config)),
                          num_workers=d.num_workers,
                          prefetch_buffer_size=d.prefetch_buffer_size)
    return pipeline.BatchIterator(ds, mesh, shard, d.global_batch_size, d.seq_len,
                                  pipeline.load_metadata(next(iter(dirs.values()))), seed_offset=seed_offset,
                                  sources=records)
