"""The step-time model against published TPU step times: the points, the fit of its constants,
the error on the points held out.

Every point is a published measurement (source in `source`), described as a longctx config would
run it: the model's shape, the sequence, the batch, the mesh, the strategy. MaxText's runs differ
from longctx's in their kernels (tokamax's ring, MaxText's all-gather), their remat policies
(mapped to the nearest longctx policy, `remat` below) and details a published table leaves out
(block sizes where not stated: 512, MaxText's default). So the error below is the model's error
on other programs of the same shapes: what a user planning a run from published figures gets.

Fitted (`fit`): the seven shared numbers of step_time.CONSTANTS, on the points with fit=True
only (FIT): one dense run at 8,192 tokens (the matmuls), and CP runs that span short and long
shards and every kind of strategy on v5p and TPU7x (the attention kernel's efficiency as a
function of the work per call, its cost per live grid step, per grid step with nothing live and
per call, TPU7x's cost per score element, and the per-collective latency). Every other point is
held out and its error reported apart, by range of sequence length (LENGTH_RANGES). A chip
measured here (plan/chip_points.py: v5e) has its own kernel and matmul constants, fitted on
its own timings given these; no published point runs on it, so they move none of them.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
from scipy import optimize

from longctx.plan import attention_work, chip_points, hardware, memory_model, step_time
from longctx.model import attention as attention_lib
from longctx.ops import context_parallel, masks

MODELS = {  # (vocab, d_model, layers, heads, kv heads, head_dim, mlp)
    "llama2-7b": (32_000, 4096, 32, 32, 32, 128, 11_008),
    "llama3-8b": (128_256, 4096, 32, 32, 8, 128, 14_336),
    "llama3-70b": (128_256, 8192, 80, 64, 8, 128, 28_672),
    "llama3-405b": (128_256, 16_384, 126, 128, 8, 128, 53_248),
    # the long-context recipes' variant: 16 query heads of 256 (4 KV heads), stock otherwise
    "llama3.1-8b-hd256": (128_256, 4096, 32, 16, 4, 256, 14_336),
}

PR4687 = "MaxText PR #4687 (github.com/AI-Hypercomputer/maxtext/pull/4687), table 1"
PR4836 = "MaxText PR #4836 (maxtext commit 0998c01c), USP without load balancing"
PR4893 = "MaxText PR #4893 (github.com/AI-Hypercomputer/maxtext/pull/4893), load balancing on"
RECIPES = "AI-Hypercomputer/tpu-recipes, training/"
# The long-context recipes' tables of measured step time by sequence length (tpu-recipes commit
# 1898d3ecd1a9d2e6103179041d0ba8d5c3897d99, "Measured Step Time"; 1M and up: the "Verified
# benchmark performance" table's steady-state step, the UBench run).
LONG_TPU7X = RECIPES + "ironwood/Llama3.1-8B-LongContext-Maxtext/cluster_toolkit/README.md @1898d3ec"
LONG_V5P = RECIPES + "v5p/Llama3.1-8B-LongContext-Maxtext/cluster_toolkit/README.md @1898d3ec"


@dataclasses.dataclass(frozen=True)
class Point:
    source: str
    topology: str
    model: str
    seq_len: int
    batch: int
    mesh: tuple[int, int, int]   # dp, fsdp, sp
    cp: str
    degree: int | None
    layout: str
    block: int
    remat: str                   # the nearest longctx policy to the run's
    published_seconds: float
    fit: bool = False

    @property
    def label(self) -> str:
        cp = self.cp if self.degree is None else f"usp {self.mesh[2] // self.degree}x{self.degree}"
        return f"{self.model} {self.seq_len // 1024}K {cp} ({self.layout})"


def _usp_points(source, layout, times):
    """PR #4836 / #4893: llama3-8b, 64 v5p chips, CP64, global batch 1; usp RxU = ring R x Ulysses U."""
    out = []
    for (label, cp, degree), row in zip(
            [("all-gather", "all_gather", None), ("ring", "ring", None), ("usp 16x4", "usp", 4),
             ("usp 8x8", "usp", 8), ("usp 32x2", "usp", 2)], times):
        for seq, seconds in zip((65_536, 131_072, 262_144), row):
            out.append(Point(source, "v5p:4x4x4", "llama3-8b", seq, 1, (1, 1, 64), cp, degree,
                             layout, 512, "nothing_saveable", seconds))
    return out


POINTS = [
    # llama2-7b, 32K, cp=16, 2M tokens per step; remat custom (context on device): the
    # matmuls recomputed, as nothing_saveable. Blocks as published.
    Point(PR4687, "v5p:4x4x4", "llama2-7b", 32_768, 64, (1, 4, 16), "ulysses", None, "contiguous",
          2048, "nothing_saveable", 8.90),
    Point(PR4687, "v5p:4x4x4", "llama2-7b", 32_768, 64, (1, 4, 16), "all_gather", None, "zigzag",
          1024, "nothing_saveable", 8.83),
    Point(PR4687, "v5p:4x4x4", "llama2-7b", 32_768, 64, (1, 4, 16), "ring", None, "zigzag",
          1024, "nothing_saveable", 16.38),
    *_usp_points(PR4836, "contiguous", [(1.31, 4.03, 14.33), (1.68, 4.63, 15.35),
                                        (1.31, 4.02, 13.92), (1.44, 4.05, 13.65),
                                        (1.65, 4.52, 14.72)]),
    *_usp_points(PR4893, "zigzag", [(1.09, 2.98, 9.71), (1.42, 3.71, 10.78), (1.04, 2.88, 9.50),
                                    (1.20, 2.93, 9.34), (1.38, 3.49, 10.24)]),
    # Dense runs at 8,192 tokens, no context parallelism; remat custom with q/k/v and the layer
    # input offloaded: the matmuls are not recomputed, as dots_saveable.
    Point(RECIPES + "trillium/Llama3.1-8B-MaxText/v6e-256", "v6e:16x16", "llama3-8b", 8192, 1024,
          (1, 256, 1), "ring", None, "contiguous", 512, "dots_saveable", 4.546),
    Point(RECIPES + "trillium/Llama3.1-70B-MaxText/v6e-256", "v6e:16x16", "llama3-70b", 8192, 1280,
          (1, 256, 1), "ring", None, "contiguous", 512, "dots_saveable", 42.656),
    Point(RECIPES + "v5p/Llama3.1-405B-MaxText", "v5p:8x8x8", "llama3-405b", 8192, 1024,
          (1, 512, 1), "ring", None, "contiguous", 512, "dots_saveable", 131.474),
]



def _long_context_points(source, topology, block, rows):
    """The long-context recipes: the Llama3.1-8B variant with 16 heads of 256, ring CP with
    causal load balancing (MaxText's dual-chunk swap: zigzag), Tokamax splash at `block`, remat
    custom with the attention output kept (context=device or offload to host: the matmuls
    recomputed, the attention not, as nothing_saveable with save_qkv), synthetic data.
    rows: (tokens, global batch, (dp, fsdp, sp), published seconds)."""
    return [Point(source, topology, "llama3.1-8b-hd256", seq, batch, mesh, "ring", None, "zigzag", block,
                  "nothing_saveable", seconds) for seq, batch, mesh, seconds in rows]


POINTS += [
    # TPU7x, 64 chips = 128 devices (one per TensorCore); global batch = per_device_batch_size x
    # 128; blocks 2,048 with 96 MiB of scoped VMEM, --xla_tpu_dvfs_p_state=7. 4M: the p7 run
    # (186.48 s; 213.68 s without it). 10M keeps the optimizer state on the host (the update's
    # transfers are not priced: 1,124 s of attention hide them). 14M and 16M offload the
    # attention output and layer inputs to the host and are left out.
    *_long_context_points(LONG_TPU7X, "tpu7x:4x4x4", 2048, [
        (65_536, 64, (1, 64, 2), 5.31), (262_144, 16, (1, 16, 8), 14.08),
        (1_048_576, 4, (1, 4, 32), 49.58), (2_097_152, 2, (1, 2, 64), 94.60),
        (4_194_304, 1, (1, 1, 128), 186.48), (10_485_760, 1, (1, 1, 128), 1124.12)]),
    # v5p, 64 chips; blocks 1,024. 256K and up keep the attention output on the host
    # (context=offload; 256K, 2M and 4M the layer inputs too): the same compute, its PCIe
    # transfers not priced. 10M (remat full) and 14M (context=remat) recompute the attention,
    # which longctx never does, and are left out.
    *_long_context_points(LONG_V5P, "v5p:4x4x4", 1024, [
        (65_536, 32, (1, 16, 4), 10.25), (262_144, 8, (1, 4, 16), 26.31),
        (1_048_576, 2, (1, 1, 64), 95.73), (2_097_152, 2, (1, 1, 64), 357.68),
        (4_194_304, 2, (1, 1, 64), 1373.73)]),
]

# The points the constants are fitted on (source, label): the dense 8B run (the matmuls); the CP
# runs span 2K to 32K tokens per device, each strategy, both layouts, blocks of 512 to 2,048,
# heads of 128 and 256, v5p and TPU7x.
FIT = {(RECIPES + "trillium/Llama3.1-8B-MaxText/v6e-256", "llama3-8b 8K ring (contiguous)"),
       (PR4687, "llama2-7b 32K all_gather (zigzag)"),
       (PR4687, "llama2-7b 32K ulysses (contiguous)"),
       (PR4893, "llama3-8b 128K all_gather (zigzag)"),
       (PR4893, "llama3-8b 64K ring (zigzag)"),
       (PR4836, "llama3-8b 256K ring (contiguous)"),
       (PR4893, "llama3-8b 256K usp 8x8 (zigzag)"),
       # the long-context recipes at 256K on each chip (TPU7x's score-element cost); every
       # point at 1M tokens and more is held out
       (LONG_TPU7X, "llama3.1-8b-hd256 256K ring (zigzag)"),
       (LONG_V5P, "llama3.1-8b-hd256 256K ring (zigzag)")}
POINTS = [dataclasses.replace(p, fit=(p.source, p.label) in FIT) for p in POINTS]

# Sequence lengths the error is reported by (tokens, inclusive); a range without a published
# point says so.
LENGTH_RANGES = {"<= 128K": (0, 131_072), "256K-512K": (262_144, 524_288),
                 ">= 1M": (1_048_576, 1 << 40)}


def point_config(base, point: Point):
    """`base` (configs/base.py's config) made into the point's run."""
    vocab, d, layers, heads, kv, hd, mlp = MODELS[point.model]
    c = copy.deepcopy(base)
    c.unlock()
    c.model.update(vocab_size=vocab, d_model=d, num_layers=layers, num_heads=heads,
                   num_kv_heads=kv, head_dim=hd, mlp_dim=mlp, dtype="bfloat16",
                   remat_policy=point.remat, mlp_chunk_size=None)
    c.attention.update(impl="splash", causal=True, cp=point.cp, cp_ulysses=point.degree,
                       layout=point.layout, block_size=point.block, use_segment_ids=False,
                       residuals="save_qkv")
    c.data.update(seq_len=point.seq_len, global_batch_size=point.batch)
    c.mesh.update(dp=point.mesh[0], fsdp=point.mesh[1], sp=point.mesh[2])
    c.lock()
    return c


def _prepared(base, point: Point, cache: dict) -> step_time.StepTerms:
    """The point's step before the constants price it (step_time.terms), counted once per fit."""
    if point not in cache:
        config = point_config(base, point)
        spec = masks.make_mask_spec(**attention_lib.mask_kwargs(config.attention))
        chosen = context_parallel.named(point.cp, point.degree)
        schedule = attention_work.static_schedule(chosen, spec, point.layout, point.seq_len,
                                                  point.mesh[2], point.block)
        cache[point] = step_time.terms(config, hardware.parse_topology(point.topology), schedule,
                                       dict(zip(("dp", "fsdp", "sp"), point.mesh)))
    return cache[point]


def predict(base, point: Point, constants: dict | None = None,
            cache: dict | None = None) -> step_time.StepEstimate:
    return _prepared(base, point, {} if cache is None else cache).estimate(constants)


def log_error(predicted: float, published: float) -> float:
    return math.log(predicted / published)


# The grid `fit` searches for the matmuls' efficiency, in steps of 0.01.
GRID = {"matmul": [x / 100 for x in range(20, 96)]}
# Fitted on the published context-parallel runs, shared by every chip not measured itself, and
# where their search starts: the kernel's efficiency e, FLOPs at peak per live grid step,
# seconds per call, per collective and per TPU7x score element, FLOPs at peak per dead grid step.
PUBLISHED_START = {"attention": 0.9, "block_overhead": 3e8, "call_overhead": 1e-4,
                   "collective_latency": 1e-6, "score_element_tpu7x": 3e-13, "dead_step": 1e8}
# Each pass of the published search begins every cost at this or more: begun at TPU7x's own
# scale (3e-13 s an element) it trades the collective latency for the launch cost (5e-17 s and
# 0.1 ms), a fit no better on the held-out runs (11.4% against 11.5%) with a latency no
# collective has.
PUBLISHED_START_FLOOR = 1e-9
# Fitted per measured chip on its kernel timings (chip_points.KernelRow), as "<key>_<chip>"
# (step_time.chip_constant), and where their search starts (v5e's: e, FLOPs at peak per live
# grid step, seconds per score element). A launch and a dead grid step stay the published
# runs': the chip's calls are one per layer, which cannot tell a launch from the work around
# it, and a causal call on one device walks as many dead steps as live ones less a row, which
# the chip's rows cannot tell apart from the live ones (the published all-gather and
# load-balanced runs can).
CHIP_KERNEL_START = {"attention": 0.8, "block_overhead": 6e7, "score_element": 4e-12}


def _rounded(constants: dict) -> dict:
    """Two decimals for the efficiencies, two significant digits for the rest: the fit's
    result as longctx holds it (step_time.CONSTANTS)."""
    out = {}
    for k, v in constants.items():
        out[k] = round(v, 2) if k.startswith(("matmul", "attention")) else float(f"{v:.2g}")
    return out


def _minimize(loss, start: dict) -> dict:
    """The constants of `start` minimising `loss(constants)` (Nelder-Mead from `start`, in
    coordinates that keep an efficiency ("attention...") in (0, 1) and the rest positive)."""
    keys = tuple(start)

    def to_constants(x):
        return {k: (1.0 / (1.0 + math.exp(-v)) if k.startswith("attention") else math.exp(v))
                for k, v in zip(keys, x)}

    def logit(e):  # an efficiency the search left at 1.0 (in floats) starts just below it
        e = min(e, 1.0 - 1e-12)
        return math.log(e / (1.0 - e))

    x0 = np.array([logit(start[k]) if k.startswith("attention") else math.log(start[k]) for k in keys])
    found = optimize.minimize(lambda x: loss(to_constants(x)), x0, method="Nelder-Mead",
                              options={"xatol": 1e-3, "fatol": 1e-6, "maxiter": 1500})
    return to_constants(found.x)


def kernel_error(row, constants: dict | None, segment_ids=None, cache: dict | None = None) -> dict:
    """{"forward", "forward_backward"}: the model's relative error on a kernel row."""
    t = chip_points.kernel_seconds(row, segment_ids, constants, cache)
    return {"forward": t["forward"] * 1e3 / row.forward_ms - 1.0,
            "forward_backward": t["forward_backward"] * 1e3 / row.forward_backward_ms - 1.0}


def _chip_of(row) -> str:
    return hardware.chip_for_device_kind(row.device_kind).name


def fit_kernel(kernel_rows, constants: dict, segments=None, without_head_dim: int | None = None) -> dict:
    """Each measured chip's kernel constants (CHIP_KERNEL_START's keys, as "<key>_<chip>")
    minimising the mean squared log error of both times (forward; forward + backward) on its
    kernel rows with fit=True (those of `without_head_dim` left out: the error by head width of
    a fit that never saw that width); `constants`: the rest (the shared launch and dead-step
    costs)."""
    out = {}
    for chip in sorted({_chip_of(r) for r in kernel_rows if r.fit}):
        chosen = [r for r in kernel_rows if r.fit and _chip_of(r) == chip and r.head_dim != without_head_dim]
        cache: dict = {}

        def loss(own, chosen=chosen, cache=cache):
            c = {**constants, **own}
            return sum(math.log1p(e) ** 2 for r in chosen
                       for e in kernel_error(r, c, _ids(segments, r), cache).values()) / max(1, len(chosen))

        start = {f"{k}_{chip}": constants.get(f"{k}_{chip}", v) for k, v in CHIP_KERNEL_START.items()}
        out.update(_minimize(loss, start))
    return out


def _ids(segments, row):
    return None if segments is None else segments(row.seq_len)


def fit(base, points=None, *, kernel_rows=(), segments=None, preset=None, steps=()) -> dict:
    """The constants minimising the mean squared log error on the points with fit=True, in two
    parts that share nothing a chip measures for itself:

      - the published runs: the matmuls' efficiency on the dense ones (sp = 1) over GRID, then
        PUBLISHED_START's constants on the context-parallel ones (Nelder-Mead), twice over;
      - each measured chip, given those: its kernel's constants on its kernel rows (fit_kernel,
        `segments(seq_len)`: the benchmark's documents), then its matmuls' efficiency
        ("matmul_<chip>") on its fitted train steps (`steps`, chip_points.ChipStep of the
        `preset` config) over GRID;

    rounded (the chip's on the rounded published ones, as step_time holds them)."""
    points = POINTS if points is None else points
    dense = [p for p in points if p.fit and p.mesh[2] == 1]
    cp = [p for p in points if p.fit and p.mesh[2] > 1]
    chip_steps = [s for s in steps if s.fit]
    cache: dict = {}

    def loss(chosen, constants):
        return sum(log_error(predict(base, p, constants, cache).seconds, p.published_seconds) ** 2
                   for p in chosen) / max(1, len(chosen))

    def step_loss(chosen, constants):
        return sum(log_error(chip_points.predict_step(preset, s, constants).seconds,
                             s.measured_seconds) ** 2 for s in chosen) / max(1, len(chosen))

    constants = {"matmul": step_time.CONSTANTS["matmul"], **PUBLISHED_START}
    for _ in range(2):
        constants["matmul"] = min(GRID["matmul"], key=lambda v: loss(dense, {**constants, "matmul": v}))
        start = {k: constants[k] if k.startswith("attention") else max(constants[k], PUBLISHED_START_FLOOR)
                 for k in PUBLISHED_START}
        constants.update(_minimize(lambda c: loss(cp, {**constants, **c}), start))
    constants = _rounded(constants)

    if any(r.fit for r in kernel_rows):
        constants.update(_rounded(fit_kernel(kernel_rows, constants, segments)))
    for chip in sorted({hardware.parse_topology(s.topology).chip.name for s in chip_steps}):
        own = [s for s in chip_steps if hardware.parse_topology(s.topology).chip.name == chip]
        constants[f"matmul_{chip}"] = min(
            GRID["matmul"], key=lambda v: step_loss(own, {**constants, f"matmul_{chip}": v}))
    return constants


def compare(base, points=POINTS, constants: dict | None = None) -> list[dict]:
    rows, cache = [], {}
    for p in points:
        e = predict(base, p, constants, cache)
        rows.append({"label": p.label, "source": p.source, "topology": p.topology,
                     "seq_len": p.seq_len,
                     "mesh": dict(zip(("dp", "fsdp", "sp"), p.mesh)), "fit": p.fit,
                     "published_seconds": p.published_seconds, "predicted_seconds": e.seconds,
                     "error": e.seconds / p.published_seconds - 1.0, "predicted_mfu": e.mfu,
                     "bound": e.bound})
    return rows


def summary(rows: list[dict]) -> dict:
    """Mean absolute relative error, fitted and held-out points apart."""
    def mean_abs(rs):
        return sum(abs(r["error"]) for r in rs) / len(rs) if rs else float("nan")
    fitted = [r for r in rows if r["fit"]]
    held = [r for r in rows if not r["fit"]]
    return {"fit_points": len(fitted), "fit_mean_abs_error": mean_abs(fitted),
            "held_out_points": len(held), "held_out_mean_abs_error": mean_abs(held),
            "held_out_max_abs_error": max((abs(r["error"]) for r in held), default=float("nan"))}


def by_length(rows: list[dict]) -> list[dict]:
    """Mean absolute relative error per LENGTH_RANGES range, fitted and held-out points apart
    (None where a range has none)."""
    out = []
    for name, (lo, hi) in LENGTH_RANGES.items():
        inside = [r for r in rows if lo <= r["seq_len"] <= hi]
        errors = lambda fit: [abs(r["error"]) for r in inside if r["fit"] == fit]  # noqa: E731
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        out.append({"range": name, "fit_points": len(errors(True)),
                    "fit_mean_abs_error": mean(errors(True)),
                    "held_out_points": len(errors(False)),
                    "held_out_mean_abs_error": mean(errors(False))})
    return out


# ----------------------------------------------------------------------------- memory

@dataclasses.dataclass(frozen=True, eq=False)
class MemoryPoint:
    """A whole-step TPU compile (plan/aot.py) of `config` on `mesh`: its HBM per chip."""
    label: str
    config: object
    mesh: dict
    measured_bytes: int
    fit: bool = False


def fit_activation_scale(points) -> float:
    """memory_model.ACTIVATION_SCALE by least squares on the points with fit=True: the measured
    bytes beyond the state and gradients, against the activations the model counts."""
    xs, ys = [], []
    for p in points:
        if p.fit:
            e = memory_model.per_device_bytes(p.config, p.mesh)
            xs.append(e.saved_bytes + e.working_bytes)
            ys.append(p.measured_bytes - e.state_bytes - e.gradient_bytes)
    return round(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 2)


def compare_memory(points, scale: float | None = None) -> list[dict]:
    rows = []
    for p in points:
        e = memory_model.per_device_bytes(p.config, p.mesh)
        if scale is not None:
            e = dataclasses.replace(e, scale=scale)
        rows.append({"label": p.label, "mesh": p.mesh, "fit": p.fit, "measured_bytes": p.measured_bytes,
                     "predicted_bytes": e.total_bytes, "error": e.total_bytes / p.measured_bytes - 1.0})
    return rows
