"""Small helpers for code running inside `jax.shard_map`, shared by the ring and its backends."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def pick(table, d, t):
    """table[d, t] of a host table, with d = this device and t = traced run-step index."""
    return jnp.asarray(table)[d, t]


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.9: manual-axis type; older: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(tree, ref):
    """Marks `tree` as varying over the mesh axes `ref` varies over (shard_map's vma typing).

    Fresh constants (zeros, -inf) are device-invariant; loop carries and cond branches must
    have the same type as the device-varying values they are combined with.
    """
    want = _varying_axes(ref)

    def one(x):
        missing = tuple(sorted(want - _varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def sum_over_devices(x):
    """`x` summed over every mesh axis it varies over: the gradient of a replicated input from
    each device's share (what the transpose of `vary_like` does inside a custom VJP's caller)."""
    axes = tuple(sorted(_varying_axes(x)))
    return lax.psum(x, axes) if axes else x


def max_over_devices(x):
    """The maximum of `x` over every device of the enclosing shard_map (all its manual axes),
    the same on all of them: e.g. the trip count of a loop of collectives, which every device of
    the program must run equally often (two sp rings that ran different counts would leave
    each other's collectives waiting)."""
    axes = tuple(sorted(jax.sharding.get_abstract_mesh().manual_axes))
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    if missing:
        x = lax.pcast(x, missing, to="varying")
    return lax.pmax(x, axes)
