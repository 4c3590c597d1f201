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
  [7X]  cloud.google.com/tpu/docs/tpu7x ("TPU7x (Ironwood)", system architecture): per chip 2,307
        dense bf16 TFLOP/s, 192 GiB HBM at 7,380 GB/s, two TensorCores, 1,200 GB/s bidirectional ICI
        (the same as v5p's, so v5p's per-link figure), 100 Gb/s DCN; 3-D torus in 4x4x4 cubes
        joined by optical switches, as v5p. Its programming model shows each TensorCore as its own
        device (no megacore): libtpu's "tpu7x:2x2x1" is 8 devices "TPU7x" on 4 chips, two per
        chip coordinate (core_on_chip 0 and 1).
  [NV]  NVIDIA H100 and H200 datasheets (SXM): dense bf16, HBM, NVLink 900 GB/s both ways;
        InfiniBand NDR 400 Gb/s per GPU.
"""

from __future__ import annotations

import dataclasses
import math

from longctx.model import flops
from longctx.plan import measured_memory

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
    devices_per_chip: int = 1  # jax devices on one chip: TPU7x shows its two TensorCores apart

    @property
    def program_share(self) -> float | None:
        """The share of a step's temporaries this chip's runtime was measured to hold, or None
        (plan/measured_memory.py)."""
        shares = [s for s in map(measured_memory.program_share, self.device_kinds) if s is not None]
        return max(shares) if shares else None

    def per_device(self) -> "Chip":
        """The chip as one of its jax devices sees it: compute, HBM and its bandwidth, and the
        chip's links and DCN split evenly between its devices (a mesh axis is laid over devices).
        The chip itself where it is one device (every chip but TPU7x)."""
        n = self.devices_per_chip
        if n == 1:
            return self
        return dataclasses.replace(self, peak_flops=self.peak_flops / n, hbm_bytes=self.hbm_bytes // n,
                                   hbm_bandwidth=self.hbm_bandwidth / n,
                                   ici_link_bandwidth=self.ici_link_bandwidth / n,
                                   dcn_bandwidth=self.dcn_bandwidth / n, devices_per_chip=1)


def _peak(device_kind: str) -> float:
    """Dense bf16 FLOP/s: model/flops.py's table, which MFU reads too."""
    return flops.PEAK_TFLOPS_BY_CHIP[device_kind] * 1e12


CHIPS = {
    "v4": Chip("v4", ("TPU v4",), _peak("TPU v4"), 32 * GIB, 1.2e12, 4.5e10, 3, 4, 6.25e9, "[SB] [GCP]"),
    # v5e: the 16 GiB less what the runtime keeps, as a chip reports it (bytes_limit, 15.75 GiB):
    # the compiler refuses a program against that figure
    "v5e": Chip("v5e", ("TPU v5 lite", "TPU v5e"), _peak("TPU v5e"), 16_909_336_064, 8.1e11, 4.5e10,
                2, 16, 3.125e9, "[SB] [GCP]"),
    "v5p": Chip("v5p", ("TPU v5", "TPU v5p"), _peak("TPU v5p"), 95 * GIB, 2.8e12, 9e10, 3, 4, 6.25e9,
                "[SB] [GCP]"),
    "v6e": Chip("v6e", ("TPU v6 lite", "TPU v6e"), _peak("TPU v6e"), 32 * GIB, 1.64e12, 9e10, 2, 16,
                3.125e9, "[SB] [GCP]"),
    "tpu7x": Chip("tpu7x", ("TPU7x",), 2 * _peak("TPU7x"), 192 * GIB, 7.38e12, 9e10, 3, 4, 1.25e10,
                  "[7X]", devices_per_chip=2),
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

    @property
    def num_devices(self) -> int:
        """The jax devices of the slice: a mesh's size (tpu7x:4x4x4: 64 chips, 128 devices)."""
        return self.num_chips * self.chip.devices_per_chip

    @property
    def device(self) -> Chip:
        """What one of those devices has (Chip.per_device)."""
        return self.chip.per_device()


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
    # Small axes first: the mesh builder fills them first. An axis of one chip (v5p:2x2x1's last)
    # has no links and spans nothing.
    remaining = sorted(d for d in topology.shape if d > 1)
    spans = {}
    on_chip = topology.chip.devices_per_chip  # TPU7x: the innermost axis's first factor of 2
    for axis in order:
        n, span = sizes[axis], 0.0
        if on_chip > 1 and n > 1:  # ... spans the chip's own two devices, no torus axis
            taken = on_chip if n % on_chip == 0 else 1
            n, on_chip = n // taken, on_chip // taken
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
