"""The step-time model against what this repository measured on a TPU chip itself: the attention
kernels' timings (benchmarks/bench_tpu_kernels.py, docs/tpu_kernels.json) and whole train steps
(scripts/train.py, docs/tpu.md), each a point marked fit or held out, as plan/calibration.py's
published points are.

A kernel row is one attention call on one device (sp = 1: the sequence is the shard), priced by
step_time.attention_pass_seconds on the blocks the planner's schedule gives it: the static mask's
for causal and window rows, the ring's tables on the benchmark's documents for longctx's
document rows. Stock splash skips no block by document (it compares segment ids per element, on
its static causal mask: 54.3 against 54.8 ms causal at 32,768 tokens), so its document rows are
priced as causal ones.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from longctx import config as config_lib
from longctx.model import attention as attention_lib
from longctx.ops import context_parallel, masks, strategy_schedule, tables
from longctx.plan import attention_work, hardware, step_time

# The benchmark's window (bench_tpu_kernels.WINDOW): token i sees [i - 4,096, i].
WINDOW = 4096
# Kernel rows the constants are fitted on: longctx's own kernels (what a run drives) at 32,768
# and 65,536 tokens with the blocks a plan tries (512, 1,024, 2,048: each compiles within the
# scoped VMEM the kernels ask for), causal and window masks, every head width. Held out: 8,192
# tokens (where what the benchmark's call does around the kernel weighs most), documents (the
# kernel walks grid steps the planner's document tables do not count), and stock splash (another
# kernel).
FIT_KERNEL = {"impl": ("longctx",), "seq_len": (32_768, 65_536), "block": (512, 1024, 2048),
              "mask": ("causal", "window")}


@dataclasses.dataclass(frozen=True)
class KernelRow:
    impl: str            # longctx | stock
    mask: str            # causal | window | documents
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    forward_ms: float
    forward_backward_ms: float
    device_kind: str
    fit: bool = False

    @property
    def label(self) -> str:
        return (f"{self.impl} {self.mask} {self.seq_len // 1024}K heads {self.heads}x{self.head_dim} "
                f"block {self.block}")


def kernel_rows(doc: dict) -> list[KernelRow]:
    """docs/tpu_kernels.json's timed rows (those with both times), marked fit by FIT_KERNEL."""
    out = []
    for r in doc["rows"]:
        if "fwd_ms" not in r or "fwdbwd_ms" not in r or r["mask"] not in ("causal", "window", "documents"):
            continue
        row = KernelRow(r["impl"], r["mask"], r["S"], r["heads"], r["kv_heads"], r["head_dim"],
                        r["block"], r["fwd_ms"], r["fwdbwd_ms"], doc["device"])
        out.append(dataclasses.replace(row, fit=all(getattr(row, k) in v for k, v in FIT_KERNEL.items())))
    return out


def _schedule(row: KernelRow, segment_ids: np.ndarray | None):
    ring = context_parallel.named("ring")
    window = (WINDOW, 0) if row.mask == "window" else None
    spec = masks.make_mask_spec(causal=True, sliding_window=window)
    if row.mask == "documents" and row.impl == "longctx":
        ids = np.asarray(segment_ids, np.int32)[None]
        one = tables.document_schedule(spec, "contiguous", row.seq_len, 1, row.block, ids, count_kept=False)
        return strategy_schedule.from_ring_schedule(ring, one, spec, "contiguous", row.seq_len, 1, row.block)
    return attention_work.static_schedule(ring, spec, "contiguous", row.seq_len, 1, row.block)


def kernel_seconds(row: KernelRow, segment_ids: np.ndarray | None = None,
                   constants: dict | None = None, cache: dict | None = None) -> dict[str, float]:
    """{"forward", "forward_backward"}: the model's seconds for the row's call, as the step's
    attention prices one layer (step_time.attention_pass_seconds). `segment_ids` [seq_len]: the
    benchmark's documents (bench_tpu_kernels._segments), for a longctx document row."""
    cache = {} if cache is None else cache
    key = (row.impl == "longctx" and row.mask == "documents", row.mask, row.seq_len, row.block)
    if key not in cache:
        cache[key] = _schedule(row, segment_ids)
    sched = cache[key]
    chip = hardware.chip_for_device_kind(row.device_kind)
    t = step_time.attention_pass_seconds(chip, sched.critical_path, row.block, row.heads,
                                         row.head_dim, 1.0, step_time.dead_steps(sched), constants)
    return {"forward": t["forward"], "forward_backward": t["forward"] + t["backward"]}


# ----------------------------------------------------------------------------- train steps

TPU_MD = "docs/tpu.md (one TPU v5e chip, {day})"
FIRST_RUNS, ACCUMULATION_RUNS = TPU_MD.format(day="2026-12-06"), TPU_MD.format(day="2026-12-07")


@dataclasses.dataclass(frozen=True)
class ChipStep:
    """A train step of configs/base.py's `v5e_0p5b` preset with `overrides` (config keys), its
    median step time after the first (steps 2-6, or 2-8) on one chip of `topology`."""
    label: str
    overrides: dict
    measured_seconds: float
    topology: str = "v5e:1x1"
    source: str = FIRST_RUNS
    fit: bool = False


def _causal(block: int = 1024, **overrides) -> dict:
    """One causal row at the block the run was measured with (named: the preset's own block may
    change after a point is measured)."""
    return {"attention.use_segment_ids": False, "attention.block_size": block, **overrides}


# One causal row each (the documents' runs vary 1.22-1.83 s a step with the pairs their rows
# keep, which the planner prices only from the rows themselves). Fitted: 8,192 and 32,768 tokens
# at blocks of 1,024 (the matmuls' efficiency on the chip); the rest held out.
STEPS = [
    ChipStep("causal 8K", _causal(**{"data.seq_len": 8192}), 0.285, fit=True),
    ChipStep("causal 16K", _causal(**{"data.seq_len": 16_384}), 0.643),
    ChipStep("causal 32K", _causal(), 1.670, fit=True),
    ChipStep("causal 32K, blocks of 2,048", _causal(2048), 1.567),
    ChipStep("causal 64K, 4 layers", _causal(**{"data.seq_len": 65_536, "model.num_layers": 4}), 2.679),
    ChipStep("causal 32K, save_dot_except_mlp", _causal(**{"model.remat_policy": "save_dot_except_mlp"}),
             1.821),
    ChipStep("causal 16K, 4 rows, grad_accum_steps=4",
             _causal(**{"data.seq_len": 16_384, "data.global_batch_size": 4,
                        "train.grad_accum_steps": 4}), 2.518),
    ChipStep("causal 32K, blocks of 2,048, recompute_qkv",
             _causal(2048, **{"attention.residuals": "recompute_qkv"}), 1.602,
             source=ACCUMULATION_RUNS),
    ChipStep("causal 32K, blocks of 2,048, recompute_qkv, 4 rows, grad_accum_steps=4",
             _causal(2048, **{"attention.residuals": "recompute_qkv", "data.global_batch_size": 4,
                              "train.grad_accum_steps": 4}), 6.335,
             source=ACCUMULATION_RUNS),
]


def step_config(preset, point: ChipStep):
    """The preset's config (configs/base.py:v5e_0p5b) with the point's overrides."""
    c = copy.deepcopy(preset)
    config_lib.apply_overrides(c, point.overrides)
    return c


def predict_step(preset, point: ChipStep, constants: dict | None = None) -> step_time.StepEstimate:
    """The model's step for the point: the run's own block, mask and policies, on one chip."""
    config = step_config(preset, point)
    a = config.attention
    spec = masks.make_mask_spec(**attention_lib.mask_kwargs(a))
    sched = attention_work.static_schedule(attention_lib.strategy_of(a), spec, a.layout,
                                           config.data.seq_len, 1, int(a.block_size))
    return step_time.estimate(config, hardware.parse_topology(point.topology), sched,
                              {"dp": 1, "fsdp": 1, "sp": 1}, constants=constants)
