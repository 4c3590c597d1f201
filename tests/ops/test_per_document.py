"""The ring and every other context-parallel strategy in a per-row layout against the dense
float32 reference: forward and the gradients of q, k, v and the sinks.

Natural-order rows of packed documents are laid out one by one (parallel/document_layout.py:
each row its own permutation and numbering of its documents), attended by the ring and put back
in natural order, and compared with the reference on the natural rows. Every mask runs with one
impl or the other (windows, chunks per document, sinks, soft cap and GQA spread over the cases);
a row in an arbitrary order (a random permutation, ids numbered by each document's first column)
checks that the per-row block tests never drop a needed block on rows the layout did not make;
all-gather, Ulysses, usp and halo run a mask each.
By default a covering subset runs (every strategy once; forward and every gradient; windows,
chunks per document, sinks, soft cap and GQA each reached); every case runs with
LONGCTX_EXHAUSTIVE=1.
Shapes: sp 4, shards of 256 tokens, blocks of 128, head_dim 32.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from longctx.ops import context_parallel, reference_attention
from longctx.parallel import document_layout
from tests.ops import oracle
from tests.ops.test_ring_attention import (FWD_TOL, GRAD_TOL, HEADS, MASKS, _inputs, _mesh,
                                           _positions, _out_and_grads)

SP, SHARD, BLOCK = 4, 256, 128
SEQ_LEN = SP * SHARD


def _documents(seed, batch):
    """Natural-order segment ids [batch, S]: per row a long document (over two shards), some
    of a block or two, a few tokens long ones, and padding at the end of one row."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(batch):
        lengths = [int(rng.integers(300, 600))]
        while sum(lengths) < SEQ_LEN:
            lengths.append(int(rng.choice([3, 40, 130, 200, 260])))
        row = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:SEQ_LEN].astype(np.int32)
        if r == 1:
            row[-100:] = 0
        rows.append(rng.permutation(len(lengths))[row - 1] + 1 if r == 2 else row)
        rows[-1] = np.where(row > 0, rows[-1], 0).astype(np.int32)
    return np.stack(rows)


def _laid_out(seg, arbitrary: bool):
    """(permutation [b, S], layout-order ids [b, S]) of every row: the per-document layout's, or
    with `arbitrary` a random permutation whose ids are 1 + each document's first column (the
    numbering global_positions reads)."""
    perms, ids = [], []
    for r, row in enumerate(seg):
        if arbitrary:
            starts, lengths = document_layout.documents(row)
            first = np.zeros(SEQ_LEN, np.int32)
            for s, n in zip(starts, lengths):
                first[s:s + n] = s + 1
            perm = np.random.default_rng(r).permutation(SEQ_LEN)
            perms.append(perm)
            ids.append(np.where(row > 0, first, 0)[perm])
        else:
            layout = document_layout.row_layout(row, SP, BLOCK)
            perms.append(layout.permutation)
            ids.append(layout.segment_ids)
    return np.stack(perms), np.stack(ids).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _ring_program(impl, mask_items, soft_cap, with_aux, strategy, degree):
    mesh = _mesh(SP, 2)
    data = P(("dp", "fsdp"), "sp")

    def per_shard(q, k, v, ids, pos, aux):
        return context_parallel.context_parallel_attention(
            q, k, v, ids, None, aux, positions=pos, logits_soft_cap=soft_cap, axis_name="sp",
            layout=document_layout.NAME, impl=impl, block_sizes=BLOCK, strategy=strategy,
            ulysses_degree=degree, **dict(mask_items))

    def ring(q, k, v, seg, perm, ids, aux):
        f = jax.shard_map(per_shard, mesh=mesh, in_specs=(data,) * 5 + (P() if with_aux else None,),
                          out_specs=data)
        take = lambda x: jnp.take_along_axis(x, perm.reshape(perm.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
        out = f(take(q), take(k), take(v), ids, take(_positions(seg)), aux)
        back = jnp.argsort(perm, axis=1)
        return jnp.take_along_axis(out, back[:, :, None, None], axis=1)

    def program(q, k, v, seg, perm, ids, aux, dout):
        out, vjp = jax.vjp(lambda q, k, v, aux: ring(q, k, v, seg, perm, ids, aux), q, k, v, aux)
        return out, vjp(dout)

    return jax.jit(program)


@functools.lru_cache(maxsize=None)
def _ref_program(mask_items, soft_cap):
    def ref(q, k, v, qs, ks, aux):
        return reference_attention(q, k, v, qs, ks, aux, positions=_positions(qs),
                                   logits_soft_cap=soft_cap, **dict(mask_items))

    return jax.jit(functools.partial(_out_and_grads, ref))


def _check(*, impl, mask, kv_heads, with_aux, soft_cap, arbitrary=False, seed=0, strategy="ring",
           degree=None):
    q, k, v, _, aux, dout = _inputs(seed, 4, SEQ_LEN, kv_heads)
    seg = _documents(seed, 4)
    aux = aux if with_aux else None
    perm, ids = _laid_out(seg, arbitrary)
    mask_items = tuple(sorted(MASKS[mask].items()))
    out, grads = _ring_program(impl, mask_items, soft_cap, with_aux, strategy, degree)(
        q, k, v, jnp.asarray(seg), jnp.asarray(perm), jnp.asarray(ids), aux, dout)
    ref_out, ref_grads = _ref_program(mask_items, soft_cap)(q, k, v, jnp.asarray(seg), None, aux,
                                                            dout)
    oracle.assert_matches_reference(out, grads, ref_out, ref_grads, FWD_TOL, GRAD_TOL)


CASES = [  # every mask once over the two impls; GQA, sinks and soft cap spread over them
    ("xla", "causal", 2, True, None),
    ("splash", "causal", HEADS, False, 5.0),
    ("xla", "causal_window", HEADS, False, 5.0),
    ("splash", "two_sided_window", 2, True, None),
    ("xla", "chunked", 2, True, None),
    ("splash", "chunked_window", HEADS, True, None),
    ("xla", "full", HEADS, True, 5.0),
    ("splash", "symmetric_window", 2, False, None),
]

EXHAUSTIVE = bool(os.environ.get("LONGCTX_EXHAUSTIVE"))


def _subset(cases, default):
    """`cases` as parameters, those not in `default` skipped unless LONGCTX_EXHAUSTIVE is set."""
    skip = pytest.mark.skip(reason="runs with LONGCTX_EXHAUSTIVE=1")
    return [pytest.param(*c, marks=() if EXHAUSTIVE or c in default else skip) for c in cases]


# By default: chunks per document under a window, with sinks (splash); the arbitrary order's
# case adds a causal window with soft cap and GQA (xla); the other strategies reach causal and
# chunked masks and windows with both impls.
@pytest.mark.parametrize("impl,mask,kv_heads,with_aux,soft_cap",
                         _subset(CASES, {("splash", "chunked_window", HEADS, True, None)}),
                         ids=lambda x: str(x))
def test_per_document_ring_matches_reference(impl, mask, kv_heads, with_aux, soft_cap):
    _check(impl=impl, mask=mask, kv_heads=kv_heads, with_aux=with_aux, soft_cap=soft_cap)


@pytest.mark.parametrize("impl,mask,soft_cap", _subset(
    [("xla", "causal_window", 5.0), ("splash", "chunked", None)], {("xla", "causal_window", 5.0)}))
def test_rows_in_an_arbitrary_order(impl, mask, soft_cap):
    _check(impl=impl, mask=mask, kv_heads=2, with_aux=True, soft_cap=soft_cap, arbitrary=True)


@pytest.mark.parametrize("strategy,degree,impl,mask,kv_heads", [
    ("all_gather", None, "xla", "causal_window", 2),
    ("ulysses", None, "splash", "causal", 2),
    ("usp", 2, "xla", "chunked", HEADS),
    ("halo", None, "splash", "symmetric_window", 2),
], ids=lambda x: str(x))
def test_every_strategy_takes_it(strategy, degree, impl, mask, kv_heads):
    _check(impl=impl, mask=mask, kv_heads=kv_heads, with_aux=True, soft_cap=None, strategy=strategy,
           degree=degree)
