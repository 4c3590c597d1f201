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
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from longctx.data import dispatch, packing, pipeline
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


def layouts_for(packer: str) -> tuple[str, ...]:
    """The layouts a packer's rows can be run under (config.validate's rule)."""
    fixed = packing.packer_layout(packer)
    return (fixed,) if fixed else layout_lib.LAYOUTS


def epoch_rows(rows: grain.IterDataset, keep: int | None) -> Rows:
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
