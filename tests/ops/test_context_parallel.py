"""all_gather, ulysses, usp and halo against the dense float32 reference: forward and the gradients of
q, k, v and the sinks, as the ring is checked (tests/ops/test_ring_attention.py, same
tolerances), on a ("dp", "fsdp", "sp") mesh with the batch over fsdp.

A covering subset (the full product, 336 cases, over an hour here, runs with
LONGCTX_EXHAUSTIVE=1: `test_full_product`): every
strategy with both impls; every mask, layout, sp in {2, 4, 8}, Ulysses degree, KV head count
(MHA, GQA, MQA: Ulysses replicates KV heads fewer than sp), documents or not, sinks and soft cap
reached by some strategy, each strategy seeing most; and the edge rows: a document over every
shard, an all-padding row, one-token documents. Shapes: L = 256 per shard, block 128, head_dim 32.
"""
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from longctx.ops import context_parallel, reference_attention, ulysses
from longctx.parallel import layout as layout_lib
from tests.ops import oracle

SHARD, BLOCK, HEAD_DIM = 256, 128, 32
FWD_TOL = dict(atol=2e-5, rtol=2e-5)   # the ring's (tests/ops/test_ring_attention.py)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)

MASKS = {  # at S = 1024 (sp = 4): windows and chunks cross shard edges
    "full": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, sliding_window=(300, 0)),
    "two_sided_window": dict(sliding_window=(200, 60)),
    "symmetric_window": dict(sliding_window=100),
    "chunked": dict(causal=True, chunk_size=384),
    "chunked_window": dict(causal=True, chunk_size=384, sliding_window=(100, 0)),
}


def _positions(seg):
    """In-document positions (0 at every document's start) of natural-order segment ids."""
    index = jnp.arange(seg.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def _documents(rng, batch, seq_len, edge_rows):
    """Packed documents crossing shard edges; with edge_rows, row 0 one document over every
    shard, row 1 one-token documents then padding to its end, row 2 (if any) all padding."""
    starts = rng.random((batch, seq_len)) < 1 / 120
    starts[:, 0] = True
    seg = np.cumsum(starts, axis=1).astype(np.int32)
    if edge_rows:
        seg[0] = 1
        seg[1] = np.where(np.arange(seq_len) < seq_len // 3, np.arange(seq_len) + 1, 0)
        seg[2:3] = 0
    return seg


@functools.lru_cache(maxsize=None)
def _programs(strategy, degree, sp, fsdp, heads, layout, impl, mask, with_seg, with_aux, soft_cap):
    mesh = jax.make_mesh((1, fsdp, sp), ("dp", "fsdp", "sp"), devices=jax.devices()[:sp * fsdp],
                         axis_types=(AxisType.Auto,) * 3)
    kw = MASKS[mask]
    seq_len = SHARD * sp
    perm = layout_lib.permutation(layout, seq_len, sp)
    data = P(("dp", "fsdp"), "sp")

    def per_shard(q, k, v, qs, pos, aux):
        return context_parallel.context_parallel_attention(
            q, k, v, qs, qs, aux, positions=pos, logits_soft_cap=soft_cap, axis_name="sp",
            layout=layout, impl=impl, block_sizes=BLOCK, strategy=strategy,
            ulysses_degree=degree, **kw)

    def attention(q, k, v, qs, aux):
        specs = (data, data, data, data if with_seg else None, data if with_seg else None,
                 P() if with_aux else None)
        f = jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=data)
        to_layout = lambda x: None if x is None else x[:, perm]  # noqa: E731
        pos = None if qs is None else _positions(qs)
        return f(*map(to_layout, (q, k, v, qs, pos)), aux)[:, layout_lib.inverse_permutation(perm)]

    def reference(q, k, v, qs, aux):
        pos = None if qs is None else _positions(qs)
        return reference_attention(q, k, v, qs, qs, aux, positions=pos, logits_soft_cap=soft_cap, **kw)

    def out_and_grads(fn, q, k, v, qs, aux, dout):
        out, vjp = jax.vjp(lambda q, k, v, aux: fn(q, k, v, qs, aux), q, k, v, aux)
        return out, vjp(dout)

    return (jax.jit(functools.partial(out_and_grads, attention)),
            jax.jit(functools.partial(out_and_grads, reference)))


def _check(strategy, impl, layout, mask, *, sp=4, degree=None, heads=4, kv_heads=2,
           with_seg=True, with_aux=False, soft_cap=None, edge_rows=False, fsdp=2):
    seq_len, batch = SHARD * sp, 2 * fsdp
    rng = np.random.default_rng(sp * 7 + heads)
    q = jnp.asarray(rng.standard_normal((batch, seq_len, heads, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_len, kv_heads, HEAD_DIM)), jnp.float32)
            for _ in range(2))
    aux = jnp.asarray(rng.standard_normal(heads), jnp.float32) if with_aux else None
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    qs = jnp.asarray(_documents(rng, batch, seq_len, edge_rows)) if with_seg else None
    attention, reference = _programs(strategy, degree, sp, fsdp, heads, layout, impl, mask,
                                     with_seg, with_aux, soft_cap)
    out, grads = attention(q, k, v, qs, aux, dout)
    ref_out, ref_grads = reference(q, k, v, qs, aux, dout)
    oracle.assert_matches_reference(out, grads, ref_out, ref_grads, FWD_TOL, GRAD_TOL)


CASES = [  # strategy, impl, layout, mask, keywords
    ("all_gather", "xla", "contiguous", "causal_window", dict(with_aux=True)),
    ("all_gather", "xla", "striped", "full", dict(sp=2, kv_heads=4, with_seg=False, soft_cap=5.0)),
    ("all_gather", "splash", "zigzag", "chunked", dict(with_aux=True, edge_rows=True)),
    ("ulysses", "xla", "zigzag", "causal", dict(kv_heads=1, with_aux=True, edge_rows=True)),
    ("ulysses", "xla", "contiguous", "two_sided_window", dict(sp=2, with_seg=False, soft_cap=5.0)),
    ("ulysses", "xla", "striped", "chunked_window", dict(sp=8, heads=8, fsdp=1)),
    ("ulysses", "splash", "striped", "symmetric_window", dict(kv_heads=1, soft_cap=5.0)),
    ("usp", "xla", "striped", "chunked", dict(degree=2, with_aux=True)),
    ("usp", "xla", "zigzag", "symmetric_window", dict(sp=8, degree=2, kv_heads=4, fsdp=1,
                                                       with_seg=False)),
    ("usp", "xla", "contiguous", "full", dict(sp=8, degree=4, kv_heads=1, fsdp=1, edge_rows=True)),
    ("usp", "splash", "contiguous", "causal_window", dict(degree=2, soft_cap=5.0, with_aux=True)),
    ("halo", "xla", "contiguous", "chunked_window", dict(with_aux=True, edge_rows=True)),
    ("halo", "xla", "zigzag", "two_sided_window", dict(sp=8, fsdp=1, with_seg=False, soft_cap=5.0)),
    ("halo", "xla", "striped", "causal", dict(kv_heads=1)),
    ("halo", "splash", "zigzag", "causal_window", dict(with_aux=True)),
]


@pytest.mark.parametrize("strategy,impl,layout,mask,keywords", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_strategy_matches_reference(strategy, impl, layout, mask, keywords):
    _check(strategy, impl, layout, mask, **keywords)


def _full_product():
    """strategy x mask x impl x documents x sp (x U for usp), 8 heads over 2 KV heads; layouts,
    sinks and soft cap cycled over the cases."""
    sizes = [("all_gather", sp, None) for sp in (2, 4, 8)] + [("ulysses", sp, None) for sp in (2, 4, 8)]
    sizes += [("usp", 4, 2), ("usp", 8, 2), ("usp", 8, 4)] + [("halo", sp, None) for sp in (2, 4, 8)]
    cases = []
    for i, ((strategy, sp, degree), mask, impl, with_seg) in enumerate(
            itertools.product(sizes, MASKS, ("xla", "splash"), (True, False))):
        layout = layout_lib.LAYOUTS[i % 3]
        cases.append(pytest.param(strategy, impl, layout, mask, dict(
            sp=sp, degree=degree, heads=8, kv_heads=2, fsdp=1, with_seg=with_seg,
            with_aux=i % 2 == 0, soft_cap=5.0 if i % 5 == 0 else None),
            id=f"{strategy}{degree or ''}-sp{sp}-{impl}-{layout}-{mask}-{'seg' if with_seg else 'noseg'}"))
    return cases


_NOT_ASKED = pytest.param(None, None, None, None, None, marks=pytest.mark.skip(
    reason="the full product runs with LONGCTX_EXHAUSTIVE=1 (336 cases, over an hour)"))


@pytest.mark.parametrize("strategy,impl,layout,mask,keywords",
                         _full_product() if os.environ.get("LONGCTX_EXHAUSTIVE") else [_NOT_ASKED])
def test_full_product(strategy, impl, layout, mask, keywords):
    _check(strategy, impl, layout, mask, **keywords)


@pytest.mark.parametrize("heads,kv_heads,degree", [(4, 2, 4), (8, 2, 8), (4, 1, 4), (8, 4, 2),
                                                   (24, 4, 6)])
def test_every_query_head_gets_its_kv_head(heads, kv_heads, degree):
    """Local query head i of device r reads K/V slot i // (n/U / slots) (the backends' grouping):
    that slot holds the K/V head global query head r * n/U + i reads, and a device holds no K/V
    head that none of its query heads reads. KV heads divisible by U, fewer than U (each sent to
    several devices), and groups straddling devices (24 heads, 4 KV heads, U = 6)."""
    slots = ulysses.kv_head_slots(heads, kv_heads, degree)
    local, group = heads // degree, heads // kv_heads
    for r in range(degree):
        read = [(r * local + i) // group for i in range(local)]
        assert [slots[r, i // (local // slots.shape[1])] for i in range(local)] == read
        assert set(slots[r]) == set(read)


@pytest.mark.parametrize("strategy,degree,heads,message", [
    ("ulysses", None, 6, "query heads (6) divisible by 4: use strategy 'usp' with a degree"),
    ("usp", 3, 6, "the Ulysses degree 3 must divide the sp size 4"),
    ("usp", None, 4, "strategy='usp' needs ulysses_degree"),
    ("ring", 2, 4, "ulysses_degree=2 is only for strategy='usp'"),
    ("spiral", None, 4, "strategy='spiral' is not one of"),
])
def test_bad_strategy_arguments_are_one_sentence(strategy, degree, heads, message):
    mesh = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4], axis_types=(AxisType.Auto,))
    q = jnp.zeros((1, 4 * 128, heads, 32))

    def per_shard(q):
        return context_parallel.context_parallel_attention(q, q, q, strategy=strategy,
                                                           ulysses_degree=degree, impl="xla")

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jax.shard_map(per_shard, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
