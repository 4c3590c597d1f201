"""`attention.block_size=auto` on a TPU chip whose kernels were timed: the block measured fastest.

benchmarks/bench_tpu_kernels.py times longctx's kernels on a chip at every block it is given and
keeps the forward + backward times in tpu_block_timings.json, beside this module, per chip kind
(jax's device_kind), mask kind and tokens per device. A run that leaves its block to auto on such
a chip takes the block that was fastest for its mask kind at the measured shard length nearest
its own (in ratio), among the blocks that divide its shard, for the measured head shape nearest
its own. Elsewhere the planner's step-time model chooses (plan/auto.py), as on chips nobody has
timed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_block_timings.json")
MASK_KINDS = ("causal", "window", "documents", "full")


@dataclasses.dataclass(frozen=True)
class MeasuredBlock:
    block: int
    shard_len: int          # the measured tokens per device it was chosen at
    mask: str
    times_ms: dict          # block -> forward + backward ms at that length, every block measured

    def describe(self, device_kind: str) -> str:
        others = ", ".join(f"{ms:.1f} at {b}" for b, ms in sorted(self.times_ms.items())
                           if b != self.block)
        return (f"attention.block_size=auto: {self.block}, the fastest measured on {device_kind} "
                f"for {self.mask} attention at {self.shard_len:,} tokens per device "
                f"({self.times_ms[self.block]:.1f} ms forward + backward; {others}; "
                "docs/tpu_kernels.md)")


def mask_kind(attention) -> str:
    """The measured mask kind nearest a config's `attention` section."""
    if attention.get("sliding_window") is not None or attention.get("chunk_size") is not None:
        return "window"
    if attention.get("use_segment_ids", False):
        return "documents"
    return "causal" if attention.get("causal", True) else "full"


def load(path: str = TABLE) -> dict:
    """{device_kind: [{mask, shard_len, block, fwdbwd_ms}, ...]}; empty where nothing is kept."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def best_block(device_kind: str, mask: str, shard_len: int, fits, *, head_dim: int,
               group: int = 1, table: dict | None = None):
    """The MeasuredBlock for a run of `shard_len` tokens per device, `head_dim` wide heads and
    `group` query heads per K/V head, or None where `device_kind` has no timings of `mask` (or of
    a block `fits(block)` accepts). The timings of the nearest measured head shape count (head
    width first, then group, each in ratio): a kernel's best block moves with the width of the
    tiles it multiplies. Only lengths at which two blocks or more were timed count: one block is
    no comparison."""
    timed: dict[tuple, dict[int, dict[int, float]]] = {}  # shape -> length -> block -> ms
    for r in (load() if table is None else table).get(device_kind, []):
        if r["mask"] == mask and fits(r["block"]):
            shape = (r["head_dim"], r["heads"] // r["kv_heads"])
            timed.setdefault(shape, {}).setdefault(r["shard_len"], {})[r["block"]] = r["fwdbwd_ms"]
    timed = {shape: {n: t for n, t in lengths.items() if len(t) >= 2}
             for shape, lengths in timed.items()}
    timed = {shape: lengths for shape, lengths in timed.items() if lengths}
    if not timed:
        return None
    compared = timed[min(timed, key=lambda s: (  # a tie: the smaller shape
        abs(math.log(s[0] / head_dim)), abs(math.log(s[1] / group)), s))]
    nearest = min(compared, key=lambda n: abs(math.log(n / shard_len)))
    times = compared[nearest]
    return MeasuredBlock(min(times, key=times.get), nearest, mask, times)


def table_rows(bench_rows) -> list:
    """What benchmarks/bench_tpu_kernels.py keeps of a chip's rows: longctx's (one device: the
    sequence is the shard), MHA and GQA alike."""
    return [dict(mask=r["mask"], shard_len=r["S"], block=r["block"], fwdbwd_ms=r["fwdbwd_ms"],
                 heads=r["heads"], kv_heads=r["kv_heads"], head_dim=r["head_dim"])
            for r in bench_rows if r.get("impl") == "longctx" and "fwdbwd_ms" in r]
