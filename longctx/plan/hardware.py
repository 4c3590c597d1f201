"""The accelerators the planner knows: peak compute, HBM, and the links collectives run over.

One row per chip, each figure with its source. Bandwidths are bytes/s, one direction, per link.
TPU chips sit on a torus of ICI links (v4 and v5p: 3-D, wrap-around on axes of 4 or more chips
in a full cube; v5e and v6e: 2-D, wrap-around on axes of 16), slices talk over DCN; GPUs sit in
8-GPU NVLink domains (the "ICI" figure below) joined by InfiniBand (the "DCN" figure).

Sources:
  [SB]  "How to Scale Your Model", ch. 2 "How to Think About TPUs" (jax-ml.github.io/scaling-book/
        tpus): bf16 FLOP/s, HBM capacity and bandwidth, ICI bandwidth per link, DCN per chip.
  [GCP] cloud.google.com/tpu/docs/system-architecture-tpu-vm (v4, v5e, v5p, v6e pages): peak,
        HBM, topology.
  [NV]  NVIDIA H100 and H200 datasheets (SXM): dense bf16, HBM, NVLink 900 GB/s both ways;
        InfiniBand NDR 400 Gb/s per GPU.
"""

from __future__ import annotations

import dataclasses
import math

from longctx.model import flops

GB = 1e9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                  # the prefix of libtpu's topology names (v5p:4x4x4), or a GPU's
    device_kinds: tuple        # jax's device_kind strings for it
    peak_flops: float          # dense bf16 FLOP/s (model/flops.py's table, which MFU reads)
    hbm_bytes: int
    hbm_bandwidth: float       # bytes/s
    ici_link_bandwidth: float  # bytes/s, one direction, one link (GPU: NVLink per GPU)
    torus_dims: int            # 3 (v4, v5p), 2 (v5e, v6e); 0: a switch (GPU NVLink)
    wraparound_at: int         # a torus axis of at least this many chips has its wrap-around link
    dcn_bandwidth: float       # bytes/s per chip, one direction, across slices (GPU: InfiniBand)
    source: str


def _peak(device_kind: str) -> float:
    """Dense bf16 FLOP/s: model/flops.py's table, which MFU reads too."""
    return flops.PEAK_TFLOPS_BY_CHIP[device_kind] * 1e12


CHIPS = {
    "v4": Chip("v4", ("TPU v4",), _peak("TPU v4"), 32 * GIB, 1.2e12, 4.5e10, 3, 4, 6.25e9, "[SB] [GCP]"),
    "v5e": Chip("v5e", ("TPU v5 lite", "TPU v5e"), _peak("TPU v5e"), 16 * GIB, 8.1e11, 4.5e10, 2, 16,
                3.125e9, "[SB] [GCP]"),
    "v5p": Chip("v5p", ("TPU v5", "TPU v5p"), _peak("TPU v5p"), 95 * GIB, 2.8e12, 9e10, 3, 4, 6.25e9,
                "[SB] [GCP]"),
    "v6e": Chip("v6e", ("TPU v6 lite", "TPU v6e"), _peak("TPU v6e"), 32 * GIB, 1.64e12, 9e10, 2, 16,
                3.125e9, "[SB] [GCP]"),
    "h100": Chip("h100", ("NVIDIA H100 80GB HBM3",), _peak("NVIDIA H100 80GB HBM3"), 80 * GB, 3.35e12,
                 4.5e11, 0, 0, 5e10, "[NV]"),
    "h200": Chip("h200", ("NVIDIA H200",), _peak("NVIDIA H200"), 141 * GB, 4.8e12, 4.5e11, 0, 0, 5e10,
                 "[NV]"),
}


def chip_for_device_kind(device_kind: str) -> Chip | None:
    for chip in CHIPS.values():
        if device_kind in chip.device_kinds:
            return chip
    return None


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice: its chip and the chips along each torus axis ("v5p:4x4x4" -> (4, 4, 4))."""
    chip: Chip
    shape: tuple[int, ...]
    name: str

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)


def parse_topology(name: str) -> Topology:
    """"v5p:4x4x4" -> Topology; ValueError with one sentence for a name it cannot read."""
    kind, _, dims = name.partition(":")
    chip = CHIPS.get(kind)
    if chip is None or not dims:
        raise ValueError(f"topology {name!r} is not CHIP:AxBxC with CHIP one of {', '.join(CHIPS)} "
                         "(e.g. v5p:4x4x4, v5e:16x16).")
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        raise ValueError(f"topology {name!r}: {dims!r} is not sizes joined by x (e.g. 4x4x4).") from None
    if any(d < 1 for d in shape):
        raise ValueError(f"topology {name!r}: every size must be at least 1.")
    return Topology(chip, shape, name)


def axis_links(topology: Topology, sizes: dict[str, int], order: tuple[str, ...]) -> dict[str, float]:
    """How many torus axes each mesh axis spans (its collectives' parallel link directions / 2).

    Mesh axes take the torus axes innermost first, in `order` (the mesh's innermost axis first:
    sp, then fsdp, then dp, as mesh.make_mesh lays them out); an axis of n chips that fills whole
    torus axes spans log(n)/log(axis) of them. A GPU box is one switch: every axis spans one.
    The figure is what the collective formulas divide by: an all-gather over an axis spanning k
    torus axes with wrap-around moves its bytes over 2k link directions at once.
    """
    if topology.chip.torus_dims == 0:
        return {a: 1.0 for a in order}
    remaining = sorted(topology.shape)  # small axes first: the mesh builder fills them first
    spans = {}
    for axis in order:
        n, span = sizes[axis], 0.0
        while n > 1 and remaining:
            d = remaining[0]
            if n >= d:
                n //= d
                span += 1.0
                remaining.pop(0)
            else:  # part of a torus axis
                span += math.log(n) / math.log(d)
                remaining[0] = d // n
                n = 1
        spans[axis] = span
    return spans


def has_wraparound(topology: Topology, axis_size: int) -> bool:
    return topology.chip.torus_dims == 0 or axis_size >= topology.chip.wraparound_at
