"""A run's state and where it lives: `TrainState` (step, parameters, optimizer state, rng), its
shardings over the mesh, `Setup` (everything static about the state, built once with
`make_setup`), the one builder of the abstract state with shardings (what a restore or an
ahead-of-time compile takes in place of arrays), and the run's concrete sequence layout.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from longctx import ops
from longctx.data import packing
from longctx.model import attention as attention_lib
from longctx.model import layer_types
from longctx.model.decoder import Decoder
from longctx.parallel import mesh as mesh_lib
from longctx.train.optimizer import make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array  # per-step randomness is fold_in(rng, step), so a resumed run is the same run


def resolve_layout(config, sp: int, documents=None) -> str:
    """The concrete sequence layout for this run: "auto" resolved by the ring's schedule with the
    run's attention.block_size, on `documents` (segment ids of rows the run will see, e.g.
    data.layout_sample's) where given and attention.use_segment_ids masks them. A packer that
    places documents for one layout (shard_balanced: contiguous) decides "auto" alone."""
    fixed = packing.packer_layout(config.data.packer)
    if fixed is not None and config.attention.layout == "auto":
        return fixed
    if not config.attention.use_segment_ids:
        documents = None
    # One layout for every layer: a hybrid model's is scored over its layer types, each weighted
    # by its layer count (a model without a pattern is one type).
    types = layer_types.period(config)
    counts = collections.Counter()
    for layer_type, count in zip(types, layer_types.layer_counts(config.model.num_layers, len(types))):
        counts[layer_type.name] += count
    by_name = {layer_type.name: layer_type.attention for layer_type in types}
    layers = [(count, attention_lib.mask_kwargs(by_name[name]), by_name[name].block_size)
              for name, count in counts.items()]
    return ops.resolve_layout_for_layers(config.attention.layout, config.data.seq_len, sp, layers,
                                         segment_ids=documents)


def _logical_shardings(mesh, tree, rules=None):
    """NamedShardings for a tree that holds nnx Variables (parameters carry logical axis names)."""
    specs = nnx.get_partition_spec(tree)  # logical names, e.g. P('layers', 'embed', 'mlp')
    return jax.tree.map(lambda spec: NamedSharding(mesh, mesh_lib.logical_to_spec(tuple(spec), rules)),
                        specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(config, mesh, abstract_state: TrainState) -> TrainState:
    """Parameters by the logical rules (over fsdp x sp); the optimizer state the same, or also over
    dp with optimizer.shard_state_over_dp (ZeRO-1)."""
    shardings = _logical_shardings(mesh, abstract_state)
    over_dp = bool(config.optimizer.get("shard_state_over_dp", False))
    return shardings.replace(opt_state=_logical_shardings(
        mesh, abstract_state.opt_state, mesh_lib.optimizer_rules(over_dp)))


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything static about a run's state: how to rebuild the model and how it is sharded."""

    graphdef: Any
    abstract_state: TrainState
    state_shardings: TrainState
    batch_sharding: NamedSharding
    optimizer: optax.GradientTransformation
    init: Callable[[jax.Array], TrainState]  # jitted, parameters born sharded


def make_setup(config, mesh, layout: str) -> Setup:
    """eval_shape -> shardings -> jit(init, out_shardings=...): no full copy ever on one device."""
    optimizer = make_optimizer(config)
    graphdefs = []  # the model's static structure, captured while tracing init

    def init(rng):
        model = Decoder(config, layout=layout, rngs=nnx.Rngs(params=rng))
        graphdef, params = nnx.split(model, nnx.Param)
        graphdefs.append(graphdef)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=rng)

    abstract_state = jax.eval_shape(init, jax.random.PRNGKey(0))
    graphdef = graphdefs[0]
    shardings = state_shardings(config, mesh, abstract_state)
    return Setup(graphdef=graphdef, abstract_state=abstract_state, state_shardings=shardings,
                 batch_sharding=mesh_lib.batch_sharding(mesh), optimizer=optimizer,
                 init=jax.jit(init, out_shardings=shardings))



def shard_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs (or arrays)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def abstract_with_shardings(abstract_tree, shardings):
    """`abstract_tree`'s leaves as ShapeDtypeStructs that carry the matching leaf of `shardings`:
    what Orbax restores into, and what `jit(...).lower` compiles for, without an array in memory."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_tree, shardings)
