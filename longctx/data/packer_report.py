"""What the ring does with each packer's rows (scripts/ring_report.py --data / --mix): the
critical path against the ideal, the ring steps visited and the K/V passed per row, and the
padding. The ring's side is ops/tables.document_schedule, the host copy of what it runs.

  ideal          kept blocks / sp: every device equally busy on needed blocks only
  critical path  per batch of `batch_size` rows (what one ring pass computes at once), the sum
                 over its run steps of the busiest device's blocks; summed over the batches
  visited        ring steps the ring goes through for one row (K/V travel a hop between two)
  K/V passed     (visited - 1) hops x seq_len tokens (every device sends its L tokens per hop)
                 x kv_bytes_per_token, for one layer's forward pass
  padding        padding tokens / all tokens, over every row of one epoch

and bounds computed from the pieces the rows hold (a document, or a seq_len piece of a longer
one), so a packer's and a layout's figures can be held against what is possible:

  visited_bound     the fewest ring steps visited per row, on average, by any packer in any layout
  rows_visited_bound  the fewest for these rows as packed, in any layout (causal or full mask)
  contiguous_bound  the most of the ideal (ideal / critical path) any placement in the
                    contiguous layout reaches, for a causal mask
  boundary_padding  the least padding of any packer that starts every piece longer than a
                    shard on a shard boundary (shard_balanced's rule 2, data/dispatch.py)
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from longctx.data import dispatch, mixture, packing, pipeline, sharding
from longctx.ops import tables
from longctx.ops.masks import MaskSpec
from longctx.parallel import layout as layout_lib

# Llama-3-8B's K and V per token and layer in bfloat16: 2 x 8 KV heads x 128 x 2 bytes.
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2


@dataclasses.dataclass(frozen=True)
class Rows:
    """Segment ids of the first rows of one epoch, and the padding of the whole epoch."""
    segment_ids: np.ndarray  # [rows, seq_len], natural order, 0 = padding
    padding: float
    epoch_rows: int


def layouts_for(packer: str, row_layouts: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The layouts a packer's rows can be run under (config.validate's rule): the static ones,
    and those of `row_layouts` asked for (a per-row layout takes any packer's rows)."""
    fixed = packing.packer_layout(packer)
    return (fixed,) if fixed else layout_lib.LAYOUTS + tuple(row_layouts)


def epoch_rows(rows, keep: int | None) -> Rows:
    """Reads every row of a one-epoch stream; keeps the segment ids of the first `keep` (all:
    None)."""
    kept, real, count, seq_len = [], 0, 0, None
    for row in rows:
        seq_len = len(row["segment_ids"])
        if keep is None or len(kept) < keep:
            kept.append(row["segment_ids"])
        real += int(row["loss_mask"].sum())
        count += 1
    return Rows(np.stack(kept), 1.0 - real / (count * seq_len), count)


def data_rows(data_dir: str, packer: str, *, seq_len: int, sp: int, block: int,
              keep: int | None, seed: int = 0) -> Rows:
    """One epoch of a prepared data directory's train split, shuffled with `seed`."""
    return epoch_rows(pipeline.packed_rows(data_dir, "train", seq_len=seq_len, packer=packer,
                                           seed=seed, num_epochs=1, num_shards=sp,
                                           block_size=block), keep)


def mixture_rows(config, packer: str, *, seq_len: int, sp: int, block: int, rows: int,
                 seed: int = 0) -> Rows:
    """The first `rows` rows of a config's data mixture (data.sources, mixture.py: each source
    packed on its own, rows taken by token share), with `packer`; its padding over those rows."""
    config = config.copy_and_resolve_references()
    config.data.update(seq_len=seq_len, packer=packer, shuffle_seed=seed)
    config.attention.block_size = block
    mixed, _ = mixture.mixture_rows(config, mixture.source_dirs(config),
                                    shard=sharding.DataShard(0, 1, 0, 1), sp=sp)
    it = iter(mixed)
    try:
        return epoch_rows((next(it) for _ in range(rows)), None)
    finally:
        mixture.close_iterator(it)


def document_rows(documents, packer: str, *, seq_len: int, sp: int, block: int,
                  keep: int | None, seed: int = 0) -> Rows:
    """One epoch of in-memory documents (int32 ids), in their order."""
    ds = grain.MapDataset.source(documents).to_iter_dataset()
    pairs = sum(len(d) - 1 for d in documents)
    return epoch_rows(pipeline.pack_documents(ds, seq_len=seq_len, packer=packer, seed=seed,
                                              pad_id=0, pairs_per_epoch=pairs, num_shards=sp,
                                              block_size=block), keep)


def row_schedules(spec: MaskSpec, layout: str, seq_len: int, sp: int, block: int,
                  segment_ids: np.ndarray) -> list[tables.DocumentSchedule]:
    """document_schedule of every row alone (blocks computed are not counted as needed)."""
    return [tables.document_schedule(spec, layout, seq_len, sp, block, segment_ids[r:r + 1],
                                     count_kept=False) for r in range(len(segment_ids))]


def kept_blocks(spec: MaskSpec, seq_len: int, sp: int, block: int, segment_ids: np.ndarray,
                contiguous: list[tables.DocumentSchedule] | None = None) -> int:
    """Blocks holding a pair the mask and the documents allow, over the rows: the same in every
    layout whose blocks are block-aligned ranges of positions (all three at the default blocks).
    For a causal or full mask on packed rows this is what the contiguous ring computes (a live
    block there always holds an allowed pair: its key range ends where its query range starts,
    in a document both share), which saves the element-wise count (minutes at 128K tokens)."""
    if spec.window is None and spec.chunk is None and contiguous is not None:
        return int(sum(s.computed_blocks.sum() for s in contiguous))
    return int(tables.document_schedule(spec, dispatch.LAYOUT, seq_len, sp, block,
                                        segment_ids).kept_blocks)


def summarize(schedules: list[tables.DocumentSchedule], kept: int, sp: int, seq_len: int,
              batch_size: int = 1, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> dict:
    """The report's figures for one packer under one layout (see the module docstring)."""
    critical = 0
    for b in range(0, len(schedules), batch_size):
        computed = sum(s.computed_blocks for s in schedules[b:b + batch_size])
        critical += int(sum(computed[:, s].max() for s in range(sp) if computed[:, s].any()))
    visited = np.array([len(s.visited_steps) for s in schedules])
    ideal = kept / sp
    return {"critical_path": critical, "ideal": ideal,
            "of_ideal": ideal / critical if critical else 1.0,
            "visited_mean": float(visited.mean()), "visited_max": int(visited.max()),
            "kv_bytes_per_row": float((visited - 1).mean() * seq_len * kv_bytes_per_token),
            "device_work": [s.computed_blocks.tolist() for s in schedules]}


def pieces(segment_ids: np.ndarray) -> np.ndarray:
    """Lengths of the documents' pieces in natural-order rows [rows, seq_len] (0 = padding)."""
    out = []
    for row in segment_ids:
        starts = np.r_[0, np.flatnonzero(np.diff(row)) + 1]
        ends = np.r_[starts[1:], len(row)]
        out += [e - b for b, e in zip(starts, ends) if row[b] != 0]
    return np.asarray(out, np.int64)


def visited_bound(lengths: np.ndarray, rows: int, seq_len: int, sp: int) -> float:
    """The fewest ring steps visited per row, on average over `rows` rows holding pieces of
    `lengths`, that any packer reaches in any layout.

    A piece of n tokens lies on k >= ceil(n / L) devices (each holds L = seq_len / sp tokens of
    a row). Its first part's K/V must reach the k - 1 devices holding its later parts, each at
    its own distance along the ring, so the ring visits at least k steps (0, the step it starts
    on, included). A row visits at least the largest k among its pieces, which is at least their
    k weighted by length, sum(k n) / sum(n) >= sum(k n) / seq_len; summed over the rows and
    divided by their count."""
    shard_len = seq_len // sp
    k = -(-lengths // shard_len)
    return max(1.0, float((k * lengths).sum()) / (seq_len * rows))


def rows_visited_bound(segment_ids: np.ndarray, seq_len: int, sp: int) -> float:
    """The fewest ring steps visited per row, on average, that any layout of these rows
    [rows, seq_len] (natural order) reaches under a causal or full mask: a row visits at least
    k = ceil(n / L) steps for its longest piece of n tokens (visited_bound's argument for one
    piece), so the mean of that over the rows. It depends on which pieces share a row, which the
    packer decides, so it is at least visited_bound."""
    shard_len = seq_len // sp
    longest = [int(pieces(row[None]).max(initial=0)) for row in segment_ids]
    return float(np.mean([max(1, -(-n // shard_len)) for n in longest]))


def contiguous_bound(lengths: np.ndarray, seq_len: int, sp: int, block: int) -> float:
    """The most of the ideal (ideal / critical path, the report's `of_ideal`) that any placement
    of pieces of `lengths` in the contiguous layout reaches under a causal mask, every piece
    starting on a block (a piece across a block boundary adds blocks to both sides).

    In the contiguous layout device d receives at ring step s >= 1 the K/V of device d - s, or,
    for d < s, of a device holding later positions, which a causal mask never lets it use: at
    step s at most sp - s <= sp - 1 devices have work, so the busiest computes at least 1/(sp-1)
    of that step's blocks where the ideal gives each device 1/sp. A piece puts at least
    `off` of its blocks on steps >= 1 however it lies: step 0 holds its parts' own causal
    triangles, largest when its parts are q whole shards and the rest (n = q L + r). With W the
    blocks of all pieces and OFF the sum of `off`:
        critical path >= (W - OFF) / sp + OFF / (sp - 1),   ideal = W / sp,
    and the bound is W / sp over the right-hand side."""
    shard_len = seq_len // sp
    whole, rest = np.divmod(lengths, shard_len)
    work = dispatch.causal_blocks(lengths, block)
    off = (work - whole * dispatch.causal_blocks(np.int64(shard_len), block)
           - dispatch.causal_blocks(rest, block))
    total, off_total = float(work.sum()), float(off.sum())
    return total / (total + off_total * sp / (sp - 1) - off_total) if total else 1.0


def boundary_padding(lengths: np.ndarray, seq_len: int, sp: int) -> float:
    """The least padding (padding / all tokens) of any placement of pieces of `lengths` that
    starts every piece longer than a shard on a shard boundary: such a piece of n tokens spans k
    shards and leaves k L - n tokens of its last shard that only pieces no longer than a shard
    can fill, so whatever those rooms hold beyond all the short pieces' tokens is padding."""
    shard_len = seq_len // sp
    long = lengths[lengths > shard_len]
    room = int((-(-long // shard_len) * shard_len - long).sum())
    padding = max(0, room - int(lengths[lengths <= shard_len].sum()))
    return padding / (int(lengths.sum()) + padding) if len(lengths) else 0.0
