"""How many ICI links a pass around the sp ring crosses, on the chips the mesh gives the ring.

The mesh builder gives sp the torus axes innermost first (hardware.axis_links), and
`mesh.ring_cycle` orders the ring's chips so that each device's neighbour on the ring is one link
away. Ulysses x ring (usp) passes K/V between groups of U neighbouring devices on that cycle:
device j sends to device j + U, every device at once, and the pass waits for the farthest, so it
crosses as many links as the torus distance between positions j and j + U of the cycle (at most
U; fewer where the torus has a shorter way round), each link carrying that many sends.
"""

from __future__ import annotations

import functools
import itertools
import types

from longctx.parallel import mesh as mesh_lib
from longctx.plan import hardware


def sp_box(topology: hardware.Topology, sp: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """(extent of the chips one sp ring spans, whether each of those axes has its wrap-around
    link), as hardware.axis_links lays sp out: the smallest torus axes first, the last one in part."""
    remaining = sorted(d for d in topology.shape if d > 1)  # an axis of one chip has no links
    extent, wrap, n = [], [], sp
    while n > 1 and remaining:
        d = remaining.pop(0)
        take = d if n >= d else n
        extent.append(take)
        wrap.append(take == d and hardware.has_wraparound(topology, d))
        n //= take
    return tuple(extent) or (1,), tuple(wrap) or (False,)


@functools.lru_cache(maxsize=256)
def _cycle(topology: hardware.Topology, sp: int) -> tuple[tuple[int, ...], ...]:
    extent, _ = sp_box(topology, sp)
    cells = itertools.product(*(range(n) for n in extent))  # the builder's row-major order
    ring = [types.SimpleNamespace(coords=c) for c in cells]
    return tuple(tuple(d.coords) for d in mesh_lib.ring_cycle(ring))


def ring_order(topology: hardware.Topology, sp: int) -> tuple[tuple[int, ...], ...]:
    """The chip coordinates (within the sp box) of one sp ring in mesh.ring_cycle's order."""
    return _cycle(topology, sp)


def distance(a, b, extent, wrap) -> int:
    """Links between two chips of the box: per axis the way round where it has wrap-around."""
    out = 0
    for x, y, n, w in zip(a, b, extent, wrap):
        d = abs(x - y)
        out += min(d, n - d) if w else d
    return out


@functools.lru_cache(maxsize=1024)
def pass_hops(topology: hardware.Topology, sp: int, stride: int) -> int:
    """The most links a send from position j to position j + stride of the sp ring's cycle
    crosses (1 for the ring's own pass around a cycle; a GPU switch: 1)."""
    if topology.chip.torus_dims == 0 or sp <= 1 or stride % sp == 0:
        return 1
    # A TPU7x chip is two devices, neighbours on the ring (the innermost factor of sp): device j
    # sits on chip j // 2 of the chips' cycle, and a send between its two devices crosses no ICI
    # link (it still costs one link's time: max 1).
    per_chip = topology.chip.devices_per_chip
    chips = max(1, sp // per_chip)
    extent, wrap = sp_box(topology, chips)
    cycle = _cycle(topology, chips)
    chip_of = lambda j: cycle[(j % sp) // per_chip % chips]  # noqa: E731
    return max(1, max(distance(chip_of(j), chip_of(j + stride), extent, wrap) for j in range(sp)))
