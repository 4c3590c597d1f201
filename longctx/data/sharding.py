"""Which rows of the global batch each process feeds, and assembling the global jax.Arrays.

Batches are `[global_batch, seq_len]`, sharded `P(("dp", "fsdp"), "sp")`: rows over every
data-parallel axis, the sequence over the sp ring. A process must supply exactly the rows its
devices hold. Processes whose devices hold the same rows (they differ only along sp) form one
*data shard* and read identical data; different data shards read disjoint documents. We derive
all of this from the sharding itself (`devices_indices_map`), so it holds for any device order,
any number of processes per sp group, and multi-slice meshes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from longctx.errors import ConfigError
from longctx.parallel import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class DataShard:
    """This process's share of every global batch."""

    index: int  # which data shard this process reads, 0 <= index < count
    count: int  # number of distinct data shards (= processes that read different rows)
    row_start: int  # first global batch row fed by this process
    row_stop: int

    @property
    def local_batch_size(self) -> int:
        return self.row_stop - self.row_start


def batch_sharding(mesh) -> jax.sharding.NamedSharding:
    return mesh_lib.batch_sharding(mesh)


def data_shard(mesh, global_batch_size: int, seq_len: int, process_index: int | None = None,
               process_of: Callable[[jax.Device], int] | None = None) -> DataShard:
    """The data shard of `process_index` (default: this process).

    `process_of` maps a device to its process (default `device.process_index`); tests use it to
    simulate several processes on one host.
    """
    process_index = jax.process_index() if process_index is None else process_index
    shards = data_shards(mesh, global_batch_size, seq_len, process_of)
    if process_index not in shards:
        raise ConfigError(f"process {process_index} owns no device of the mesh.")
    return shards[process_index]


def data_shards(mesh, global_batch_size: int, seq_len: int,
                process_of: Callable[[jax.Device], int] | None = None) -> dict[int, DataShard]:
    """`{process: its DataShard}` for every process that owns a device of `mesh`: the whole
    process -> rows map, the same on every process (a saved data-iterator state records it)."""
    process_of = process_of or (lambda d: d.process_index)
    num_rows = mesh.shape[mesh_lib.DP] * mesh.shape[mesh_lib.FSDP]
    if global_batch_size % num_rows:
        raise ConfigError(f"data.global_batch_size={global_batch_size} is not divisible by "
                          f"dp*fsdp = {num_rows}.")
    index_map = batch_sharding(mesh).devices_indices_map((global_batch_size, seq_len))
    rows_of: dict[int, set[tuple[int, int]]] = {}
    for device, idx in index_map.items():
        sl = idx[0]
        start, stop, _ = sl.indices(global_batch_size)
        rows_of.setdefault(process_of(device), set()).add((start, stop))
    ranges = {}
    for proc, blocks in rows_of.items():
        blocks = sorted(blocks)
        for (_, a_stop), (b_start, _) in zip(blocks, blocks[1:]):
            if a_stop != b_start:
                raise ConfigError(f"process {proc} holds non-contiguous batch rows {blocks}; the "
                                  "mesh device order must give each process a contiguous block.")
        ranges[proc] = (blocks[0][0], blocks[-1][1])
    distinct = sorted(set(ranges.values()))
    sizes = {b - a for a, b in distinct}
    covered = [r for a, b in distinct for r in range(a, b)]
    if len(sizes) != 1 or covered != list(range(global_batch_size)):
        raise ConfigError(f"processes feed overlapping or unequal batch rows {distinct}; each "
                          "process must hold whole, equal, disjoint blocks of rows.")
    return {proc: DataShard(distinct.index((start, stop)), len(distinct), start, stop)
            for proc, (start, stop) in sorted(ranges.items())}


def make_global_batch(local: dict[str, np.ndarray], mesh, global_batch_size: int,
                      seq_len: int) -> dict[str, jax.Array]:
    """Process-local rows `[local_batch, seq_len]` -> global arrays `[global_batch, seq_len]`.

    The local rows carry the whole sequence; JAX slices out the sp shards this process's devices
    hold (the sequence dimension equals the global one, so it is treated as replicated input).
    """
    sharding = batch_sharding(mesh)
    shape = (global_batch_size, seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}
