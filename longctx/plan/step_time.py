"""A model of one train step's time on a TPU slice (or GPUs), from the config alone.

    estimate(config, topology, schedule) -> StepEstimate
    terms(config, topology, schedule).estimate(constants)   # the same, counted once for many constants

Per device: the matmuls of the model (model/flops.py, plus what remat recomputes) at a fraction
of the chip's peak, or at HBM speed where their operands make them slower; the attention blocks
the device computes on the strategy's critical path (plan/attention_work.py: the ring's tables,
documents included where the caller sampled them); the optimizer update at HBM speed; and every
collective as bytes over the links the mesh puts it on (hardware.py).

A hybrid model (attention.pattern, model/layer_types.py) is priced per layer type: each type's
attention blocks, collectives and exposed FSDP traffic with its own mask, strategy and block,
times its layer count (`per_type` says what each adds); the matmuls, the optimizer and dp are one
for the step.

What overlaps what (the model's assumptions: the mesh's here, each strategy's in its own account):
  - FSDP weight all-gathers (forward, and again in the backward) and gradient reduce-scatters
    overlap the layer's own compute (XLA's async collectives); a layer waits only for what its
    compute cannot hide: max(0, collective - compute), per layer.
  - A context-parallel collective overlaps the pass's blocks where its strategy says it is
    issued under them (ops/strategy.py `Transfer.under_blocks`, in each strategy's module: the
    ring's K/V pass, sent before a step computes, and usp's pass between groups), and takes
    max(0, transfer - blocks) of the step; the others are exposed whole (all-gather's gather and
    reduce-scatter, which the TPU compiler runs before and after the kernel; Ulysses'
    all-to-alls, whose result the kernel needs; the halo's permutes, whose hulls its one loop of
    kernel calls waits for).
  - The dp all-reduce of gradients overlaps the backward: max(0, all-reduce - backward).
  - Collectives along a mesh axis use 2 link directions per torus axis it spans (a
    bidirectional ring; half that without wrap-around links), the ring's pass one direction of
    one link, usp's pass between groups (j to j + U) as many links as the ring's cycle puts
    between them (plan/links.py); a slice's axes never cross DCN (the planner plans one slice).

  - Every context-parallel collective costs CONSTANTS["collective_latency"] seconds that nothing
    hides (its launch and synchronisation), once per call its strategy counts (`Transfer.calls`):
    once per ring step and pass, once per gather, all-to-all or reduce-scatter.

The constants (CONSTANTS) are fitted (plan/calibration.py, docs/planner.md) in two parts. On
published runs (MaxText, tpu-recipes: v5p, v6e, TPU7x), shared by every chip not measured
itself: the fraction of peak the matmuls reach (dense runs); on context-parallel runs the
attention kernel's (kernel_efficiency: the fraction of peak its block matmuls reach, its fixed
cost per live grid step, per grid step with nothing live (splash's one grid for every device:
attention_work.GridSchedule) and per call, TPU7x's cost per score element) and the latency
above. On a TPU v5e chip measured here, that chip's own (chip_constant): its kernel's
efficiency, step cost and vector cost per score element on its kernel timings
(docs/tpu_kernels.json), its matmuls' efficiency on its train steps. Everything else is
counted.

MFU's numerator is the model FLOPs the step's documents need: the matmuls, and attention over the
(query, key) pairs the mask keeps inside each document (`document_pairs`), the same documents the
attention blocks are priced on. Rows of one document (no segment ids given) are model/flops.py's
count. Crediting a row of short documents with the causal pairs of the whole row would price the
work the ring skips as done (an 8B plan at 2,097,152 tokens in 8K-32K documents read 902% MFU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from longctx import config as config_lib
from longctx.model import attention as attention_lib
from longctx.model import flops as flops_lib
from longctx.plan import collectives, hardware, links

# Fitted by plan/calibration.py (docs/planner_calibration.md marks what each is fitted on; the
# rest is held out): `benchmarks/calibrate_planner.py` refits them and tests/plan/test_planner.py
# checks these are its result. "attention" is the fraction of peak the kernel's block matmuls
# reach once its fixed costs are paid; "block_overhead" (FLOPs at peak per live grid step: one
# q block x kv block x head), "dead_step" (FLOPs at peak per grid step with no live block:
# attention_work.GridSchedule) and "call_overhead" (seconds per kernel launch) those costs;
# "score_element_<chip>" (seconds of one device per score element) its vector work
# (kernel_efficiency); "matmul" the fraction of peak the model's matmuls reach. A "<name>_<chip>"
# is a measured chip's own figure, used on that chip in place of the shared one (chip_constant).
CONSTANTS = {"matmul": 0.45, "attention": 1.0, "block_overhead": 340000000.0, "call_overhead": 7.5e-08,
             "collective_latency": 0.00016, "score_element_tpu7x": 3.7e-13, "dead_step": 61000000.0,
             "attention_v5e": 0.86, "block_overhead_v5e": 100000000.0, "score_element_v5e": 3.5e-12,
             "matmul_v5e": 0.73}

# The model's mean absolute error on the published runs held out of the fit (docs/
# planner_calibration.md, rounded): predicted steps closer than this are a tie (planner.break_ties).
HELD_OUT_ERROR = 0.11

# The splash kernel's backward computes 5 block matmuls to the forward's 2 (it recomputes the
# scores): hardware work is 3.5x the forward's, where model FLOPs count 3x.
ATTENTION_PASSES = {"forward": 1.0, "backward": 2.5}
# Kernels each pass launches per call: the forward one, the backward two (dK/dV, and dQ).
KERNELS_PER_PASS = {"forward": 1, "backward": 2}
# Vector work per score element of each pass, in forwards: the backward recomputes each
# probability (exp(s - logsumexp)) and forms dS = P (dP - D), about twice the forward's exp, row
# max and sum (on the v5e chip, at heads of 64 and 128 where the vector work bounds both passes,
# the backward takes 2.05-2.13x the forward: docs/tpu_kernels.json).
VECTOR_PASSES = {"forward": 1.0, "backward": 2.0}
# The chips whose kernel timings show their vector work running beside their MXUs
# (kernel_efficiency's busy: the larger of the two, each pass's vector work VECTOR_PASSES of
# score elements): those measured here (docs/tpu_kernels.json).
VECTOR_BESIDE_MXU = frozenset({"v5e"})


# AdamW's HBM traffic per parameter (float32): the parameter read and written and its gradient
# read (12), the two moments read and written (16): 28 bytes.
OPTIMIZER_BYTES = {"parameter": 12, "moments": 16}


def recompute_passes(config) -> float:
    """Forward passes over the layers' matmuls the backward runs again, as model/flops.py counts
    their FLOPs (the remat policy and attention.residuals): 1 under nothing_saveable or
    recompute_qkv, 0 under the dots policies with save_qkv, what a named policy does not keep
    with it (model/remat.py), the rest of a layer but its q/k/v under offload_qkv. The matmuls'
    HBM passes follow it as their compute does."""
    m, d = config.model, config.data
    forward = m.num_layers * 2.0 * flops_lib.matmul_params_per_layer(config) * d.global_batch_size * d.seq_len
    return flops_lib.recomputed_flops_per_step(config) / forward


def chip_constant(name: str, chip: str | None, constants: dict | None = None) -> float:
    """CONSTANTS[name] for a device of `chip`: the chip's own fitted figure where that chip was
    measured (CONSTANTS["<name>_<chip>"]), the one fitted on the published runs elsewhere (0 for
    a cost with no shared figure: score_element). One v5e chip runs a 0.5B model's matmuls at
    far more of its peak than MaxText's published runs reach with FSDP over hundreds of chips,
    and its kernel's fixed costs are its own; fitting one figure to both would price each chip
    by the other's runs."""
    c = dict(CONSTANTS, **(constants or {}))
    if chip is not None and f"{name}_{chip}" in c:
        return c[f"{name}_{chip}"]
    return c.get(name, 0.0)


def has_own_kernel_constants(chip: str | None) -> bool:
    """Whether `chip`'s attention kernel was fitted on its own timings (an "attention_<chip>"
    constant, which chip_constant prefers on that chip)."""
    return chip is not None and f"attention_{chip}" in CONSTANTS


def matmul_efficiency(chip: str, constants: dict | None = None) -> float:
    """The fraction of peak the model's matmuls reach on a device of `chip` (chip_constant)."""
    return chip_constant("matmul", chip, constants)


def kernel_efficiency(peak_flops: float, call_flops: float, grid_steps: float, kernels: int = 1,
                      constants: dict | None = None, *, head_dim: int = 128,
                      chip: str | None = None, dead_steps: float = 0.0,
                      score_elements: float | None = None) -> float:
    """The fraction of peak one attention call reaches: `call_flops` of block matmuls over
    `grid_steps` (q block, kv block, head) steps in `kernels` kernel launches, on a device of
    `chip` (hardware.Chip.name) with heads of `head_dim`; `score_elements`: the score elements
    the call's vector work covers (None: call_flops / (4 x head_dim), QK^T and PV being
    2 x head_dim multiply-adds each).

    What the kernel does (the splash kernel, ops/): every grid step pays a fixed cost besides its
    matmuls (the step's DMA issue and wait, the online softmax's bookkeeping on a block row, the
    mask and segment compare), and every launch a pipeline fill and drain; the matmuls run on
    the MXUs at a fraction e of peak, and every score element costs vector work (its exp, the
    row max and sum, the scale). So a call takes

        busy(F / (peak x e), elements x v_chip) + (steps x c_block + dead x c_dead) / peak
            + launches x c_call

    Each constant is the chip's own where that chip was measured (chip_constant: v5e's from its
    kernel timings and train steps), the published runs' elsewhere. A grid step's c_block and a
    dead one's c_dead are in FLOPs at peak (for one chip, seconds times its peak: the v5e
    chip's figure prices only v5e), c_call in seconds; v_chip in seconds of one device, per chip
    (CONSTANTS["score_element_<chip>"]), because a generation's vector units need not grow with
    its MXUs, 0 on the chips with no fitted cost (their calls are priced by their matmuls).

    busy: where the chip's vector work runs beside its MXUs (VECTOR_BESIDE_MXU), the larger of
    the two - on the v5e chip heads of 64 take as long as heads of 128 (half the matmul FLOPs,
    the same score elements: 59.8 against 59.3 ms forward + backward at 32,768 tokens, blocks
    of 1,024) where heads of 256 take 1.8x (docs/tpu_kernels.json), so the vector work bounds
    narrow heads and the MXUs wide ones. Elsewhere their sum, with F / (4 x head_dim) elements a
    pass (a vector cost per matmul FLOP at a head width). TPU7x, the one other chip with a cost,
    was never measured here: its published runs are all of heads of 256 and fit either form as
    well (held-out mean error 11.5% as a sum, 11.3% as a max; its six points within 2 points of
    each other), but the two part on heads of 128 (the max prices them as vector-bound, at half
    the efficiency of 256; the sum at 0.77x), which no TPU7x run measures and TPU7x plans of
    Llama 3 use. The sum keeps those plans, and every published prediction, where the published
    fit put them until a TPU7x chip's kernels say otherwise.

    The efficiency F / (peak x time) grows with the work per call (longer shards: the launch
    cost spread over more steps; larger blocks: the step cost over more FLOPs; wider heads: less
    vector work per FLOP), bounded by e <= 1.

    `dead_steps`: grid steps the call walks with no live block (attention_work.GridSchedule:
    splash sizes one grid for every device, the busiest row's width): no fetch, no matmul, but
    the step's issue and bookkeeping."""
    c = dict(CONSTANTS, **(constants or {}))
    e = chip_constant("attention", chip, c)
    if call_flops <= 0:
        return e
    elements = call_flops / (4.0 * head_dim) if score_elements is None else score_elements
    matmuls = call_flops / (peak_flops * e)
    vector = elements * chip_constant("score_element", chip, c)
    busy = max(matmuls, vector) if chip in VECTOR_BESIDE_MXU else matmuls + vector
    seconds = (busy + (grid_steps * chip_constant("block_overhead", chip, c)
                       + dead_steps * chip_constant("dead_step", chip, c)) / peak_flops
               + kernels * chip_constant("call_overhead", chip, c))
    return call_flops / (peak_flops * seconds)


def dead_steps(schedule) -> dict[str, float]:
    """{pass: grid steps walked with nothing live} of a schedule's critical path: static schedules
    count them (attention_work.GridSchedule), the forward and dQ walking rows and dK/dV columns;
    0 where a schedule does not count them."""
    rows = getattr(schedule, "dead_rows", 0.0)
    return {"forward": rows, "backward": rows + getattr(schedule, "dead_columns", 0.0)}


def attention_pass_seconds(chip: hardware.Chip, blocks: float, block: int, heads: int,
                           head_dim: int, calls: float, dead: dict, constants: dict | None = None
                           ) -> dict[str, float]:
    """{pass: seconds} of one layer's attention on one device: `blocks` (q block x kv block, all
    heads) of `block` tokens on the critical path over `calls` kernel calls per pass, `heads`
    query heads of `head_dim`, `dead` {pass: grid steps walked with nothing live, in blocks of
    all heads}. Each call does its share (a Ulysses block counts 1/U, for n/U heads) in each
    kernel of the pass."""
    block_flops = 4.0 * block * block * head_dim * heads  # forward, all heads
    out = {}
    for p, w in ATTENTION_PASSES.items():
        kernels = KERNELS_PER_PASS[p]
        flops = blocks * block_flops * w / calls
        e = kernel_efficiency(chip.peak_flops, flops, kernels * blocks * heads / calls, kernels,
                              constants, head_dim=head_dim, chip=chip.name,
                              dead_steps=dead[p] * heads / calls,
                              score_elements=(VECTOR_PASSES[p] * blocks * heads * block * block / calls
                                              if chip.name in VECTOR_BESIDE_MXU else None))
        out[p] = calls * flops / (chip.peak_flops * e)
    return out


def _kernel_calls(attention, schedule, cfg) -> float:
    """Kernel calls per pass of one layer on one device, by its strategy (ops/strategy.py
    `kernel_calls`: one per ring step the K/V travel for the ring and usp, one per exchange and
    the own shard for halo, one for all-gather and Ulysses)."""
    return attention_lib.strategy_of(attention).kernel_calls(cfg, schedule.steps)


@dataclasses.dataclass
class StepEstimate:
    """Seconds of one train step by what takes them, per device."""
    matmul: float            # the model's matmuls (+ remat), compute or HBM bound
    attention: float         # the attention blocks on the critical path
    optimizer: float         # AdamW's update of this device's shard (HBM bound)
    fsdp_exposed: float      # weight gathers + gradient reduce-scatters the compute did not hide
    cp_exposed: float        # the strategy's collectives the compute did not hide
    dp_exposed: float        # the gradient all-reduce over dp the backward did not hide
    communication: dict      # seconds of each collective on its links, hidden or not
    model_flops: float       # per step, all devices: MFU's numerator (model_flops_per_step)
    device_flops: float      # per step, one device: what it computes (remat and masked block parts included)
    tokens: int              # per step, all devices
    num_chips: int
    peak_flops: float
    hbm_bound_matmul: bool   # the matmuls are limited by HBM, not the MXU
    # per layer type: layers, cp, block_size, and the seconds of its attention and of what its
    # collectives and its layers' FSDP traffic leave exposed (estimate)
    per_type: dict = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.matmul + self.attention + self.optimizer + self.fsdp_exposed
                + self.cp_exposed + self.dp_exposed)

    @property
    def exposed_communication(self) -> float:
        return self.fsdp_exposed + self.cp_exposed + self.dp_exposed

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.num_chips * self.peak_flops)

    @property
    def tokens_per_second_per_chip(self) -> float:
        return self.tokens / self.seconds / self.num_chips

    @property
    def bound(self) -> str:
        """What the step spends most on: compute, memory (HBM) or communication."""
        compute = self.attention + (0.0 if self.hbm_bound_matmul else self.matmul)
        memory = self.optimizer + (self.matmul if self.hbm_bound_matmul else 0.0)
        parts = {"compute": compute, "memory": memory, "communication": self.exposed_communication}
        return max(parts, key=parts.get)

    def as_dict(self) -> dict:
        return {"step_seconds": self.seconds, "mfu": self.mfu,
                "tokens_per_second_per_chip": self.tokens_per_second_per_chip,
                "bound": self.bound, "matmul_seconds": self.matmul,
                "attention_seconds": self.attention, "optimizer_seconds": self.optimizer,
                "fsdp_exposed_seconds": self.fsdp_exposed, "cp_exposed_seconds": self.cp_exposed,
                "dp_exposed_seconds": self.dp_exposed,
                "communication_seconds": dict(self.communication),
                "model_flops": self.model_flops, "device_flops": self.device_flops,
                "per_layer_type": dict(self.per_type)}


@dataclasses.dataclass(frozen=True)
class BatchMean:
    """Several batches' schedules of one strategy (each batch the sampled rows one sp group holds,
    planner.batch_rows), priced as their mean: the blocks on each batch's own critical path, and
    the ring steps each batch's K/V travel, averaged over the batches."""
    batches: tuple  # of StrategySchedule

    @property
    def critical_path(self) -> float:
        return float(np.mean([b.critical_path for b in self.batches]))

    @property
    def degree(self) -> int:
        return self.batches[0].degree

    @property
    def steps(self) -> float:
        return float(np.mean([b.steps for b in self.batches]))


def _step_weights(schedule) -> dict[int, float]:
    """{ring steps K/V travel: share of the batches that travel them} of a schedule."""
    if not isinstance(schedule, BatchMean):
        return {int(schedule.steps): 1.0}
    out: dict[int, float] = {}
    for b in schedule.batches:
        out[int(b.steps)] = out.get(int(b.steps), 0.0) + 1.0 / len(schedule.batches)
    return out


def _collective_seconds(kind: str, sent_bytes: float, group: int, span: float, wrap: bool,
                        link: float) -> float:
    """Seconds to move `sent_bytes` (per device, as plan/collectives.py counts them) in a
    collective of `kind` over a group of `group` devices spanning `span` torus axes."""
    if group <= 1 or sent_bytes <= 0:
        return 0.0
    directions = 2.0 * max(span, 1.0) * (1.0 if wrap else 0.5)
    if kind == "permute":  # one neighbour, one direction of one link
        return sent_bytes / link
    if kind == "all_to_all":
        # A device's x bytes go 1/group to each other device, group/4 hops away on average on a
        # bidirectional ring: x * group / 4 byte-hops per device over 2 directed links each,
        # x * group / (4 * directions) per link; sent_bytes = (group - 1) / group * x.
        local = sent_bytes * group / (group - 1)
        return local * group / (4.0 * directions * link)
    return sent_bytes / (directions * link)  # all-gather, reduce-scatter, all-reduce


def _activation_bytes_per_token(config) -> float:
    """HBM bytes one layer's matmuls read and write per token, one pass (compute dtype)."""
    m = config.model
    e = 2 if m.dtype == "bfloat16" else 4
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    return e * (m.d_model + qkv + m.num_heads * m.head_dim + m.d_model  # projections in and out
                + m.d_model + 2 * m.mlp_dim + m.mlp_dim + m.d_model)   # MLP in, gate/up, down


def document_pairs(config, segment_ids: np.ndarray | None) -> float:
    """(query, key) pairs the mask keeps per row, each document attending only to itself (as the
    ring runs segment ids: positions, windows and chunks restart at each document; padding, an id
    <= 0, attends to nothing), averaged over the rows of `segment_ids` [rows, seq_len] (natural
    order); None: a row of one document."""
    a = config.attention
    mask = dict(causal=bool(a.causal), sliding_window=a.sliding_window, chunk_size=a.chunk_size)
    if segment_ids is None:
        return float(flops_lib.kept_pairs(config.data.seq_len, **mask))
    return flops_lib.pairs_in_documents(flops_lib.document_lengths(segment_ids), **mask) / len(segment_ids)


def model_flops_per_step(config, pairs_per_row: float | None = None) -> float:
    """Training FLOPs of one step (model/flops.py's), attention counted over `pairs_per_row`
    (document_pairs) instead of the static mask's pairs of a whole row where given."""
    attention = flops_lib.attention_flops_per_step(config)
    if pairs_per_row is not None:
        attention *= pairs_per_row / document_pairs(config, None)
    return flops_lib.dense_flops_per_step(config) + attention


@dataclasses.dataclass(frozen=True)
class TypeTerms:
    """One layer type's part of a step that the constants leave alone (StepTerms)."""
    name: str
    layers: int              # the model's layers of this type
    cp: str                  # its strategy
    block: int
    blocks: float            # blocks on its critical path, every row this device's sp group holds
    calls: float             # kernel calls per pass of one layer
    dead: dict               # {pass: grid steps walked with nothing live}, those rows
    # ((share of the batches, ((pass, seconds on the links, under the blocks, calls), ...)), ...):
    # its context-parallel transfers, all its layers', by the ring steps K/V travel
    transfers: tuple


@dataclasses.dataclass(frozen=True)
class StepTerms:
    """What `estimate` counts from the config, the topology and the schedule alone: everything
    but what the constants (CONSTANTS) price. `estimate(constants)` prices it; a fit that tries
    many constants on one config counts it once."""
    chip: hardware.Chip      # one mesh device
    num_layers: int
    heads: int
    head_dim: int
    dense_flops: float       # the matmuls' FLOPs of one device, remat included
    hbm_matmul: float        # seconds the matmuls' HBM traffic takes
    optimizer: float
    gather: float            # one layer's FSDP weight gathers (forward and backward), seconds
    scatter: float           # one layer's gradient reduce-scatter, seconds
    allreduce: float         # the dp gradient all-reduce, seconds
    types: tuple             # of TypeTerms
    communication: dict      # StepEstimate.communication
    model_flops: float
    device_flops: float
    tokens: int
    num_chips: int

    def estimate(self, constants: dict | None = None) -> StepEstimate:
        """The step under `constants` (CONSTANTS where None or for a key it leaves out)."""
        eff = dict(CONSTANTS, **(constants or {}))
        chip = self.chip
        compute_matmul = self.dense_flops / (chip.peak_flops * matmul_efficiency(chip.name, eff))
        matmul = max(compute_matmul, self.hbm_matmul)
        attention = fsdp_exposed = cp_exposed = 0.0
        per_type = {}
        for t in self.types:
            one_layer = attention_pass_seconds(chip, t.blocks, t.block, self.heads, self.head_dim,
                                               t.calls, t.dead, eff)
            attention_pass = {p: t.layers * s for p, s in one_layer.items()}
            type_attention = sum(attention_pass.values())
            exposed = _exposed_seconds(t.transfers, attention_pass, eff["collective_latency"])
            layer_compute = matmul / self.num_layers + type_attention / t.layers
            type_fsdp = t.layers * max(0.0, self.gather + self.scatter - layer_compute)
            attention += type_attention
            cp_exposed += exposed
            fsdp_exposed += type_fsdp
            per_type[t.name] = {
                "layers": t.layers, "cp": t.cp, "block_size": t.block,
                "attention_seconds": type_attention, "cp_exposed_seconds": exposed,
                "fsdp_exposed_seconds": type_fsdp}
        # dp: the gradient shard all-reduced, hidden behind the backward.
        backward = (matmul + attention) * 2.0 / 3.0
        dp_exposed = max(0.0, self.allreduce - backward)
        return StepEstimate(
            matmul=matmul, attention=attention, optimizer=self.optimizer, fsdp_exposed=fsdp_exposed,
            cp_exposed=cp_exposed, dp_exposed=dp_exposed, communication=dict(self.communication),
            model_flops=self.model_flops, device_flops=self.device_flops, tokens=self.tokens,
            num_chips=self.num_chips, peak_flops=chip.peak_flops,
            hbm_bound_matmul=self.hbm_matmul > compute_matmul, per_type=per_type)


def estimate(config, topology: hardware.Topology, schedule, mesh_sizes: dict[str, int], *,
             rows_in_schedule: int = 1, pairs_per_row: float | None = None,
             constants: dict | None = None) -> StepEstimate:
    """One train step of `config` on `topology` with the mesh `mesh_sizes` ({dp, fsdp, sp}).

    schedule: the attention schedule of each layer type's strategy (plan/attention_work.py) for
    `rows_in_schedule` rows, {type name: StrategySchedule} (collectives.type_layers names the
    types; "default" without a pattern), or one StrategySchedule for every type. Each type is
    priced with its own mask, strategy and block (its resolved attention config) and its layer
    count. `pairs_per_row`: the pairs the schedule's documents keep (document_pairs of the same
    rows), for MFU; None: rows of one document."""
    return terms(config, topology, schedule, mesh_sizes, rows_in_schedule=rows_in_schedule,
                 pairs_per_row=pairs_per_row).estimate(constants)


def terms(config, topology: hardware.Topology, schedule, mesh_sizes: dict[str, int], *,
          rows_in_schedule: int = 1, pairs_per_row: float | None = None) -> StepTerms:
    """What `estimate` counts before any constant prices it (its arguments but the constants)."""
    chip = topology.device  # what one mesh device has (a TPU7x chip is two)
    m, d = config.model, config.data
    dp, fsdp, sp = mesh_sizes["dp"], mesh_sizes["fsdp"], mesh_sizes["sp"]
    chips = dp * fsdp * sp
    rows = d.global_batch_size // (dp * fsdp)  # sequences each sp group holds
    tokens_per_device = rows * d.seq_len // sp
    compute_bytes = 2 if m.dtype == "bfloat16" else 4
    spans = hardware.axis_links(topology, mesh_sizes, ("sp", "fsdp", "dp"))
    link = chip.ici_link_bandwidth

    # Matmuls: model FLOPs + what remat and the residual policy recompute, split evenly.
    dense_model = flops_lib.dense_flops_per_step(config)
    dense_hw = (dense_model + flops_lib.recomputed_flops_per_step(config)) / chips
    layer_params = flops_lib.matmul_params_per_layer(config)
    passes = 3 + recompute_passes(config)  # fwd, 2 bwd, and what remat and the residuals recompute
    gathered_layer = layer_params * compute_bytes  # the layer's weights in the compute dtype
    hbm_matmul = m.num_layers * passes * (
        gathered_layer + tokens_per_device * _activation_bytes_per_token(config)) / chip.hbm_bandwidth

    # AdamW on this device's shard: read parameter, gradient, two moments; write parameter and
    # moments (float32): OPTIMIZER_BYTES per parameter, the moments' on their own shard.
    params = config_lib.num_params_estimate(config)
    param_ways = fsdp * sp
    state_ways = param_ways * (dp if config.optimizer.get("shard_state_over_dp", False) else 1)
    optimizer = (params / param_ways * OPTIMIZER_BYTES["parameter"]
                 + params / state_ways * OPTIMIZER_BYTES["moments"]) / chip.hbm_bandwidth

    # FSDP: every layer's weights gathered over fsdp x sp twice (forward, backward), gradients
    # reduce-scattered once (float32), each hidden behind that layer's compute.
    param_span = spans["fsdp"] + spans["sp"]
    param_wrap = hardware.has_wraparound(topology, max(fsdp, sp))
    share = (param_ways - 1) / param_ways
    gather = _collective_seconds("all_gather", 2 * share * gathered_layer, param_ways, param_span,
                                 param_wrap, link)
    scatter = _collective_seconds("reduce_scatter", share * layer_params * 4, param_ways, param_span,
                                  param_wrap, link)

    # Per layer type: the attention blocks on the critical path of its strategy, every row this
    # device's sp group holds; its context-parallel collectives; the FSDP traffic its layers'
    # compute does not hide (StepTerms.estimate).
    attention_hw_flops = 0.0
    cp_seconds: dict = {}
    types = []
    for layer_type, count in collectives.type_layers(config):
        a = layer_type.attention
        sched = schedule[layer_type.name] if isinstance(schedule, dict) else schedule
        block = int(a.block_size)
        blocks = sched.critical_path * rows / rows_in_schedule
        block_flops = 4.0 * block * block * m.head_dim * m.num_heads  # forward, all heads
        shape = collectives.type_shape(config, a, sp, rows)
        cfg = collectives.type_config(a, shape, config.attention.layout)
        scale = rows / rows_in_schedule
        seconds, transfers = _cp_seconds(a, shape, cfg, count, topology, sched, spans)
        for kind, t in seconds.items():
            cp_seconds[kind] = cp_seconds.get(kind, 0.0) + t
        attention_hw_flops += count * blocks * block_flops * sum(ATTENTION_PASSES.values())
        types.append(TypeTerms(
            name=layer_type.name, layers=count, cp=str(attention_lib.strategy_of(a)), block=block,
            blocks=blocks, calls=_kernel_calls(a, sched, cfg),
            dead={p: n * scale for p, n in dead_steps(sched).items()}, transfers=transfers))

    # dp: the gradient shard all-reduced (StepTerms.estimate hides it behind the backward).
    allreduce = _collective_seconds("all_reduce", 2 * (dp - 1) / dp * params / param_ways * 4, dp,
                                    spans["dp"], hardware.has_wraparound(topology, dp), link)

    return StepTerms(
        chip=chip, num_layers=m.num_layers, heads=m.num_heads, head_dim=m.head_dim,
        dense_flops=dense_hw, hbm_matmul=hbm_matmul, optimizer=optimizer, gather=gather,
        scatter=scatter, allreduce=allreduce, types=tuple(types),
        communication={"fsdp_gather": m.num_layers * gather, "fsdp_reduce_scatter": m.num_layers * scatter,
                       "dp_all_reduce": allreduce, **cp_seconds},
        model_flops=model_flops_per_step(config, pairs_per_row),
        device_flops=dense_hw + attention_hw_flops,
        tokens=d.global_batch_size * d.seq_len, num_chips=chips)


def _cp_seconds(attention, shape, cfg, layers, topology, schedule, spans):
    """({"cp_<kind>": seconds on the links}, TypeTerms.transfers) of one layer type's strategy
    (`attention`: its resolved config; `shape`, `cfg`: one of its calls) over its `layers` layers."""
    if shape.sp == 1:
        return {}, ()
    chosen = attention_lib.strategy_of(attention)
    seconds, parts = {}, []
    for steps, weight in _step_weights(schedule).items():
        transfers = chosen.transfers(shape, cfg, range(steps))
        part_seconds, part = _transfer_seconds(transfers, shape.sp, layers, topology, spans)
        for kind, t in part_seconds.items():
            seconds[kind] = seconds.get(kind, 0.0) + weight * t
        parts.append((weight, part))
    return seconds, tuple(parts)


def _transfer_seconds(transfers, sp: int, layers, topology, spans):
    """_cp_seconds of one strategy's `transfers` (ops/strategy.py: its bytes by kind and pass,
    K/V travelling a given number of steps): ({"cp_<kind>": seconds}, ((pass, seconds, under the
    blocks, calls), ...))."""
    link = topology.device.ici_link_bandwidth
    seconds, part = {}, []
    for p, parts in transfers.items():
        for t in parts:
            span = 1.0 if t.kind == "permute" else _group_span(t.group, sp, spans["sp"])
            secs = layers * _collective_seconds(t.kind, t.sent, t.group, span,
                                                hardware.has_wraparound(topology, t.group), link)
            if t.stride > 1:
                # device j sends to j + stride on the ring's cycle, all at once: every link on the
                # way carries that many sends (links.pass_hops, from mesh.ring_cycle)
                secs *= links.pass_hops(topology, sp, t.stride)
            seconds[f"cp_{t.kind}"] = seconds.get(f"cp_{t.kind}", 0.0) + secs
            part.append((p, secs, t.under_blocks, layers * t.calls))
    return seconds, tuple(part)


def _exposed_seconds(transfers, attention_pass, latency) -> float:
    """Seconds of a type's transfers (TypeTerms.transfers) the step waits for: a transfer its
    strategy issues under the blocks hides behind the pass's attention (`attention_pass`
    {pass: seconds}), the others are exposed whole; every call pays `latency`."""
    exposed = 0.0
    for weight, part in transfers:
        part_exposed = 0.0
        for p, secs, under_blocks, calls in part:
            hidden = attention_pass[p] if under_blocks else 0.0
            part_exposed += max(0.0, secs - hidden) + calls * latency
        exposed += weight * part_exposed
    return exposed


def _group_span(group: int, sp: int, sp_span: float) -> float:
    """Torus axes a collective over `group` devices of the sp axis spans: all of sp's for the
    whole axis; a Ulysses group is the inner part of sp (mesh.ring_cycle), its links sp's first."""
    return min(sp_span, math.log(group) / math.log(max(2, sp)) * sp_span)
