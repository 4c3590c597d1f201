"""Documents -> fixed-length packed rows with segment ids, positions, targets and loss mask.

Grain's packers do the packing (first_fit, best_fit, concat_then_split), or dispatch.py's
shard_balanced, which places documents into the ring's sp shards; this module only shapes what
goes in and what comes out.

What goes in: each document `d` (BOS ... EOS, n tokens) becomes its n-1 (input, target) pairs,
`d[i] -> d[i+1]`, as one `[n-1, 2]` int32 array, cut into pieces of at most `seq_len` pairs.
Shifting *before* packing means every packed position carries its own next-token target from the
same document, so nothing is lost at a document edge, and a document longer than `seq_len` is
split without dropping or duplicating a single target: every token except a document's BOS is a
target exactly once per epoch.

What comes out, per row (all int32 `[seq_len]`):
  tokens       the inputs; PAD on padding
  targets      the next token of the same document; PAD on padding
  segment_ids  1, 2, ... for the documents (or document pieces) in the row, 0 on padding
               (at the row's end; shard_balanced also leaves padding at the end of a shard)
  positions    0, 1, ... restarting at every segment, 0 on padding
  loss_mask    1 on every real position, 0 on padding
A piece of a split document is its own segment and its positions restart at 0: attention never
crosses segments, so only positions relative within a segment matter, and this keeps the
packers identical in meaning (concat-then-split would otherwise continue positions).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np
from grain import experimental as gx

from longctx.data import dispatch
from longctx.errors import ConfigError
from longctx.ops import masks
from longctx.parallel import document_layout

# The keys a packer's rows can depend on beyond the documents, their order (data.shuffle_seed) and
# the data shard: the config's values as the run resolved them ("mesh.sp": the mesh's sp axis), and
# the bins it packs into (first/best fit; shard_balanced's window rows), which follow from
# data.seq_len, the local batch and the data shard's pairs per epoch through num_packing_bins, a
# calibration a later longctx may change.
SEQ_LEN, SP, BLOCK_SIZE, BINS = "data.seq_len", "mesh.sp", "attention.block_size", "num_packing_bins"


@dataclasses.dataclass(frozen=True)
class Packer:
    """What a packer is defined for and what its rows depend on.

    `row_keys`: restored under another value of one of these, a saved iterator state re-packs its
    window into other rows and skips or repeats tokens, so their values are saved with the state
    (pipeline.BatchIterator.stream_record) and a difference restarts the stream
    (train/checkpoint_compat.data_state_mismatch). attention.layout is no such key: the layout
    permutes each row after packing (PermuteLayout), which a state does not see."""
    row_keys: tuple[str, ...]
    layout: str | None = None  # the one layout it is defined for; None: any


PACKER_REGISTRY = {
    "first_fit": Packer(row_keys=(SEQ_LEN, BINS)),
    "best_fit": Packer(row_keys=(SEQ_LEN, BINS)),
    "concat_then_split": Packer(row_keys=(SEQ_LEN,)),  # no bins: pieces pass through in order
    # places pieces into sp shards of seq_len / sp tokens, by work counted in blocks of block_size
    dispatch.PACKER: Packer(row_keys=(SEQ_LEN, SP, BLOCK_SIZE, BINS), layout=dispatch.LAYOUT),
}
PACKERS = tuple(PACKER_REGISTRY)
FEATURE = "tt"  # the packed [len, 2] (input, target) feature
KEYS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")


class SplitDocument(gx.FlatMapTransform):
    """One document of token ids -> its (input, target) pairs in pieces of <= seq_len."""

    max_fan_out = 1 << 20  # documents can be long; the iterator version does not pre-allocate

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, ids: np.ndarray):
        pairs = np.stack([ids[:-1], ids[1:]], axis=1)
        return [{FEATURE: pairs[i:i + self.seq_len]} for i in range(0, len(pairs), self.seq_len)]


def num_packing_bins(packer: str, seq_len: int, batch_size: int,
                     pairs_per_epoch: int | None = None) -> int:
    """Bins the first/best-fit packers fill before emitting them all as rows.

    Grain emits every bin as soon as one piece fits in none, so more bins = less padding, at the
    cost of buffer memory (16 bytes per position: the pair, segment id, position), documents read
    before the first row, and per-document search time (linear in bins). Calibrated on the
    stdlib corpus with benchmarks/bench_data.py: 1024 bins give best-fit >= 0.99 non-padding at 8K
    and 32K (512 gave 0.988); the budget of 8 Mi positions (128 MiB) caps very long rows.

    `pairs_per_epoch` (the (input, target) pairs one epoch of the data shard holds) caps the bins
    at the rows one epoch fills: filling 1024 bins from a split of a few short documents would
    repeat it thousands of times (minutes to hours, at O(bins) per document) before the first
    row. A corpus of more than 1024 rows per epoch is unaffected.
    """
    del packer
    bins = max(8, batch_size, min(1024, (8 << 20) // seq_len))
    if pairs_per_epoch is not None:
        bins = min(bins, max(1, -(-pairs_per_epoch // seq_len)))
    return bins


def packer_layout(packer: str) -> str | None:
    """The one layout a packer is defined for (shard_balanced: contiguous), None for any layout."""
    return PACKER_REGISTRY[packer].layout if packer in PACKER_REGISTRY else None


def bins_for(packer: str, seq_len: int, batch_size: int, num_bins: int | None = None,
             pairs_per_epoch: int | None = None) -> int:
    """The bins (shard_balanced: window rows) `pack` packs into: `num_bins`, else num_packing_bins."""
    return num_bins or num_packing_bins(packer, seq_len, batch_size, pairs_per_epoch)


def row_settings(packer: str, *, seq_len: int, num_shards: int, block_size, bins: int) -> dict:
    """`{key: value}` for the keys `packer`'s rows depend on (Packer.row_keys), from the arguments
    `pack` gets (`bins`: bins_for's)."""
    values = {SEQ_LEN: seq_len, SP: num_shards, BLOCK_SIZE: block_size, BINS: bins}
    return {key: values[key] for key in PACKER_REGISTRY[packer].row_keys}


def pack(ds: grain.IterDataset, packer: str, seq_len: int, *, batch_size: int, pad_id: int,
         seed: int, num_bins: int | None = None, pairs_per_epoch: int | None = None,
         num_shards: int = 1, block_size: int = 512) -> grain.IterDataset:
    """Packs `{FEATURE: [n<=seq_len, 2]}` elements into `seq_len` rows with grain's packers, or
    into the `num_shards` shards of each row (shard_balanced: dispatch.py; `block_size` is the
    ring's block, the unit its work is counted in)."""
    length = {FEATURE: seq_len}
    if packer == dispatch.PACKER:
        # A window holds as many rows' tokens as first/best fit have bins, with the same caps.
        rows = bins_for(packer, seq_len, batch_size, num_bins, pairs_per_epoch)
        return dispatch.ShardBalancedPackIterDataset(
            ds, feature=FEATURE, seq_len=seq_len, num_shards=num_shards, block_size=block_size,
            window_rows=rows, seed=seed, pad_id=pad_id)
    if packer in ("first_fit", "best_fit"):
        cls = gx.FirstFitPackIterDataset if packer == "first_fit" else gx.BestFitPackIterDataset
        bins = bins_for(packer, seq_len, batch_size, num_bins, pairs_per_epoch)
        return cls(ds, length_struct=length, num_packing_bins=bins,
                   seed=seed, shuffle_bins=True, padding_struct={FEATURE: pad_id})
    if packer == "concat_then_split":
        # Full-length pieces pass straight through instead of being cut at an arbitrary offset.
        return JsonRestorable(gx.ConcatThenSplitIterDataset(ds, length_struct=length,
                                                            split_full_length_features=False))
    raise ConfigError(f"data.packer={packer!r} is not one of {PACKERS}.")


class JsonRestorable(grain.IterDataset):
    """Grain's concat-then-split iterator, restorable from its state after a JSON round trip.

    Its state marks "no partly packed piece" with the tuple (-1, -1) per feature and tests it with
    `!=`; Orbax writes iterator states as JSON, which turns the tuple into the list [-1, -1], so
    a restored state seemed to hold a piece: the restore read the next piece from the parent as
    that remainder, packed an empty slice of it and dropped the rest (grain 0.2.18). Every state
    saved with no remainder (between the full-length pieces of a long document, for one) then
    restored to different rows. This restores the tuples; the state itself is unchanged, so
    states saved before stay valid.
    """

    def __init__(self, parent: grain.IterDataset):
        super().__init__(parent)

    def __iter__(self):
        return _JsonRestorableIterator(self._parent.__iter__())


class _JsonRestorableIterator(grain.DatasetIterator):
    _MUTATES_ELEMENT_SPEC = False

    def __next__(self):
        return next(self._parent)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        slices = state.get("remainder_slices")
        if isinstance(slices, dict):
            state = dict(state, remainder_slices={k: tuple(v) for k, v in slices.items()})
        self._parent.set_state(state)


class RowFeatures(grain.transforms.Map):
    """A packed grain row -> the five model features (see the module docstring)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def map(self, row):
        tt = row[FEATURE]
        seg = row[f"{FEATURE}_segment_ids"].astype(np.int32)
        real = seg > 0
        return {
            "tokens": np.where(real, tt[:, 0], self.pad_id).astype(np.int32),
            "segment_ids": seg,
            "positions": masks.segment_positions(seg),
            "targets": np.where(real, tt[:, 1], self.pad_id).astype(np.int32),
            "loss_mask": real.astype(np.int32),
        }


class PermuteEachRow(grain.transforms.Map):
    """Lays every row of a batch out in the per-document layout (parallel/document_layout.py):
    each row its own permutation, worked out from its segment ids, which are renumbered as the
    layout numbers the documents. A function of the row alone, so every host of an sp group and
    a resumed run lay a row out the same; tokens, positions, targets and loss mask travel with
    their tokens, so the loss sees every token with its own target."""

    def __init__(self, num_shards: int, block: int):
        self.num_shards, self.block = num_shards, block

    def map(self, batch):
        return document_layout.permute_rows(batch, self.num_shards, self.block)[0]


class PermuteLayout(grain.transforms.Map):
    """Reorders the sequence axis of every feature into the sp layout: x[..., perm].

    All five features move together, so each token keeps its position, segment id, target and
    mask, and the model never needs to know the order.
    """

    def __init__(self, perm: np.ndarray | None):
        self.perm = None if perm is None else np.asarray(perm)

    def map(self, batch):
        if self.perm is None:
            return batch
        return {k: np.ascontiguousarray(v[..., self.perm]) for k, v in batch.items()}
