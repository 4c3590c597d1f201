"""ring_attention against the dense float32 reference: forward and grads of q, k, v, sinks.

Every configuration is one jit (forward + VJP) over a ("dp", "fsdp", "sp") mesh with batch
sharded over fsdp (2 rows per device), on natural-order inputs permuted into the layout and
back, so the test also checks the layout bookkeeping. Each impl runs every mask once, in a layout of
its own (so every mask runs end to end in two layouts, every layout with at least four masks),
with segment ids / GQA / sinks / soft cap spread over the cases. The block tables of every kind
of mask in every layout are checked against the dense mask in tests/ops/test_tables.py; the
full product with impl="xla" (21 cases) runs with LONGCTX_EXHAUSTIVE=1. Shapes: L = 256 per
shard, block 128, head_dim 32.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from longctx.ops import reference as reference_lib
from longctx.ops import reference_attention, resolve_layout, ring_attention
from longctx.parallel import layout as layout_lib
from tests.ops import oracle

SHARD, BLOCK, HEADS, HEAD_DIM = 256, 128, 4, 32
# float32 tolerances, fixed up front (observed errors are ~1e-6).
FWD_TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)

MASKS = {  # at S = 1024 (sp = 4): windows and chunks cross shard edges
    "full": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, sliding_window=300),
    "two_sided_window": dict(sliding_window=(200, 60)),
    "symmetric_window": dict(sliding_window=100),
    "chunked": dict(chunk_size=384),
    "chunked_window": dict(chunk_size=384, sliding_window=100),
}
# (segment ids, kv heads): cycled so every mask and every layout sees all values.
VARIANTS = [(True, 2), (True, HEADS), (False, 2), (False, HEADS)]


def _mesh(sp, fsdp):
    devices = jax.devices()[:sp * fsdp]
    return jax.make_mesh((1, fsdp, sp), ("dp", "fsdp", "sp"), devices=devices,
                         axis_types=(AxisType.Auto,) * 3)


def _segments(rng, batch, seq_len):
    """Packed documents: random boundaries (crossing shard edges), different in every row."""
    starts = rng.random((batch, seq_len)) < 1 / 120
    starts[:, 0] = True
    return np.cumsum(starts, axis=1).astype(np.int32)


def _positions(seg):
    """In-document positions [b, S] (0 at every document's start) of natural-order segment ids."""
    index = jnp.arange(seg.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def _inputs(seed, batch, seq_len, kv_heads, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq_len, HEADS, HEAD_DIM))
    k = rng.standard_normal((batch, seq_len, kv_heads, HEAD_DIM))
    v = rng.standard_normal((batch, seq_len, kv_heads, HEAD_DIM))
    aux = rng.standard_normal(HEADS)
    dout = rng.standard_normal(q.shape)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), _segments(rng, batch, seq_len), cast(aux), cast(dout)


@functools.lru_cache(maxsize=None)
def _ring_program(sp, fsdp, seq_len, layout, impl, mask_items, soft_cap, with_seg, with_aux,
                  kv_segments_differ=False, block=BLOCK):
    mesh = _mesh(sp, fsdp)
    kw = dict(mask_items)
    # "auto": the data pipeline permutes rows with the layout resolve_layout names
    perm = layout_lib.permutation(resolve_layout(layout, seq_len, sp, **kw), seq_len, sp)
    data = P(("dp", "fsdp"), "sp")

    def per_shard(q, k, v, qs, ks, pos, aux):
        return ring_attention(q, k, v, qs, ks, aux, positions=pos, logits_soft_cap=soft_cap,
                              axis_name="sp", layout=layout, impl=impl, block_sizes=block, **kw)

    def ring(q, k, v, qs, ks, aux):
        f = jax.shard_map(per_shard, mesh=mesh,
                          in_specs=(data, data, data, data if with_seg else None,
                                    data if kv_segments_differ else None,
                                    data if with_seg else None, P() if with_aux else None),
                          out_specs=data)
        to_layout = lambda x: None if x is None else x[:, perm]
        pos = None if qs is None else _positions(qs)
        out = f(*map(to_layout, (q, k, v, qs, ks, pos)), aux)
        return out[:, layout_lib.inverse_permutation(perm)]

    return jax.jit(functools.partial(_out_and_grads, ring))


def _out_and_grads(fn, q, k, v, qs, ks, aux, dout):
    out, vjp = jax.vjp(lambda q, k, v, aux: fn(q, k, v, qs, ks, aux), q, k, v, aux)
    return out, vjp(dout)


@functools.lru_cache(maxsize=None)
def _ref_program(mask_items, soft_cap):
    def ref(q, k, v, qs, ks, aux):
        pos = None if qs is None else _positions(qs)
        return reference_attention(q, k, v, qs, ks, aux, positions=pos, logits_soft_cap=soft_cap,
                                   **dict(mask_items))

    return jax.jit(functools.partial(_out_and_grads, ref))


def _check(*, impl, layout, mask, with_seg, kv_heads, with_aux, soft_cap, sp=4, fsdp=2,
           seed=0, segments=None, shard=SHARD, block=BLOCK):
    """`segments`, if given, replaces the random documents: natural-order ids [batch, S]."""
    seq_len, batch = shard * sp, 2 * fsdp
    q, k, v, seg, aux, dout = _inputs(seed, batch, seq_len, kv_heads)
    seg = seg if segments is None else segments
    qs = seg if with_seg else None
    aux = aux if with_aux else None
    mask_items = tuple(sorted(MASKS[mask].items()))
    ring = _ring_program(sp, fsdp, seq_len, layout, impl, mask_items, soft_cap, with_seg, with_aux,
                         block=block)
    out, grads = ring(q, k, v, qs, None, aux, dout)
    ref_out, ref_grads = _ref_program(mask_items, soft_cap)(q, k, v, qs, None, aux, dout)
    oracle.assert_matches_reference(out, grads, ref_out, ref_grads, FWD_TOL, GRAD_TOL)


# The layout each mask runs in with impl="xla" by default: not the one SPLASH_CASES gives it.
XLA_LAYOUT = {"full": "contiguous", "causal": "striped", "causal_window": "zigzag",
              "two_sided_window": "striped", "symmetric_window": "contiguous", "chunked": "striped",
              "chunked_window": "zigzag"}
XLA_CASES = []
for mi, mask in enumerate(MASKS):
    for li, lay in enumerate(layout_lib.LAYOUTS):
        if lay != XLA_LAYOUT[mask] and not os.environ.get("LONGCTX_EXHAUSTIVE"):
            continue
        with_seg, kvh = VARIANTS[(mi + li) % 4]
        XLA_CASES.append(pytest.param(
            lay, mask, with_seg, kvh, (mi + li) % 2 == 0, 5.0 if (mi + 2 * li) % 3 == 0 else None,
            id=f"{mask}-{lay}-{'seg' if with_seg else 'noseg'}-{'gqa' if kvh < HEADS else 'mha'}"))


@pytest.mark.parametrize("layout,mask,with_seg,kv_heads,with_aux,soft_cap", XLA_CASES)
def test_xla_ring_matches_reference(layout, mask, with_seg, kv_heads, with_aux, soft_cap):
    _check(impl="xla", layout=layout, mask=mask, with_seg=with_seg, kv_heads=kv_heads,
           with_aux=with_aux, soft_cap=soft_cap)


SPLASH_CASES = [  # every mask once; layouts, segments, GQA, sinks and soft cap spread over them
    ("zigzag", "causal", True, 2, True, None),
    ("striped", "causal_window", False, HEADS, False, 5.0),
    ("contiguous", "two_sided_window", True, HEADS, True, 5.0),
    ("zigzag", "chunked", True, 2, False, None),
    ("striped", "full", True, 2, True, None),
    ("contiguous", "chunked_window", False, 2, True, None),
    ("zigzag", "symmetric_window", True, HEADS, False, None),
]


@pytest.mark.parametrize("layout,mask,with_seg,kv_heads,with_aux,soft_cap", SPLASH_CASES,
                         ids=lambda x: str(x))
def test_splash_ring_matches_reference(layout, mask, with_seg, kv_heads, with_aux, soft_cap):
    _check(impl="splash", layout=layout, mask=mask, with_seg=with_seg, kv_heads=kv_heads,
           with_aux=with_aux, soft_cap=soft_cap)


@pytest.mark.parametrize("compute", [None, BLOCK])
def test_splash_backward_adds_dq_over_many_kv_blocks(compute):
    """Shards of 4 blocks: the fused backward's dQ is read, added to and written back in HBM by
    every live (kv block, q block) step of one call, over several kv blocks, heads and batch
    rows (splash_kernels._DqAccumulator); and with blocks of 256 computed 128 keys at a time,
    each step's share sums two sub-tiles first."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    block = BLOCK if compute is None else sk.BlockSizes(
        block_q=2 * BLOCK, block_kv=2 * BLOCK, block_kv_compute=compute,
        block_kv_dkv_compute=compute, use_fused_bwd_kernel=True)
    _check(impl="splash", layout="zigzag", mask="causal_window", with_seg=True, kv_heads=2,
           with_aux=True, soft_cap=None, sp=2, fsdp=1, shard=4 * BLOCK, block=block)


@pytest.mark.parametrize("impl,shard,block,mask", [
    ("splash", 128, 128, "causal"), ("xla", 96, 48, "causal"), ("xla", 96, 48, "chunked"),
    ("xla", 45, 15, "symmetric_window")])
def test_striped_blocks_across_stripes_and_token_stripes(impl, shard, block, mask):
    """Blocks that hold more than one run of positions: shards of 128 are two stripes of 64
    (blocks of 128: two stripes each), shards of 96 three stripes of 32 (blocks of 48: a stripe
    and a half). A shard of 45 (odd) gets token stripes."""
    _check(impl=impl, layout="striped", mask=mask, with_seg=False, kv_heads=2, with_aux=False,
           soft_cap=None, shard=shard, block=block)


@pytest.mark.parametrize("impl,sp,fsdp,layout,mask", [
    ("xla", 1, 2, "contiguous", "causal"),
    ("splash", 1, 2, "contiguous", "causal"),  # one step: no accumulator (ring._one_step)
    ("xla", 8, 1, "striped", "causal_window"),
    ("xla", 8, 1, "zigzag", "chunked"),
    ("splash", 8, 1, "zigzag", "causal"),
])
def test_other_ring_sizes(impl, sp, fsdp, layout, mask):
    _check(impl=impl, layout=layout, mask=mask, with_seg=True, kv_heads=2, with_aux=True,
           soft_cap=None, sp=sp, fsdp=fsdp)


def _edge_documents(case, batch=4, seq_len=SHARD * 4):
    """Natural-order segment ids for the document edge cases (0 = padding)."""
    rng = np.random.default_rng(11)
    if case == "one_token_documents":  # every token its own document: only the diagonal attends
        return np.broadcast_to(np.arange(1, seq_len + 1, dtype=np.int32), (batch, seq_len)).copy()
    if case == "one_document_everywhere":  # a document that spans every shard
        return np.ones((batch, seq_len), np.int32)
    if case == "padding_rows":  # an all-padding row, a padded tail, and a normal row
        seg = _segments(rng, batch, seq_len)
        seg[0] = 0
        seg[1, seq_len // 3:] = 0
        return seg
    if case == "documents_inside_shards":  # contiguous shards; no document crosses an edge
        seg = _segments(rng, batch, seq_len)
        return seg + 1000 * (np.arange(seq_len) // SHARD)[None, :].astype(np.int32)
    if case == "documents_across_one_edge":  # contiguous shards; none reaches two shards back
        seg = _segments(rng, batch, seq_len)
        return seg + 1000 * ((np.arange(seq_len) + SHARD // 2) // SHARD)[None, :].astype(np.int32)
    raise ValueError(case)


@pytest.mark.parametrize("impl,case", [
    ("xla", "one_token_documents"), ("xla", "one_document_everywhere"), ("xla", "padding_rows"),
    ("xla", "documents_inside_shards"), ("xla", "documents_across_one_edge"),
    ("splash", "padding_rows"), ("splash", "documents_inside_shards"),
    ("splash", "documents_across_one_edge"),
])
def test_document_edge_cases(impl, case):
    """Exact forward and gradients where document skipping has the most to get wrong; padding
    (id 0) attends to nothing and is attended by nothing, so its rows are 0. On the contiguous
    layout the ring stops early: after its first step (documents inside shards) or its second,
    dK/dV then going home one hop back."""
    contiguous = case in ("documents_inside_shards", "documents_across_one_edge")
    _check(impl=impl, layout="contiguous" if contiguous else "zigzag",
           mask="causal", with_seg=True, kv_heads=2, with_aux=False, soft_cap=None,
           segments=_edge_documents(case))


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_a_ring_of_one_step_whose_device_holds_only_padding(impl):
    """One device (sp=1) whose rows are all padding, beside one with a padded row: the one step
    has no live block there, and its kernels walk an empty table (ring._any_live), sinks
    included."""
    segments = _edge_documents("padding_rows", seq_len=SHARD)
    segments[:2] = 0  # fsdp shard 0 holds rows 0 and 1
    _check(impl=impl, layout="contiguous", mask="causal", with_seg=True, kv_heads=2,
           with_aux=True, soft_cap=None, sp=1, fsdp=2, segments=segments)


def test_q_blocks_the_splash_forward_never_walks_are_masked(monkeypatch):
    """The splash forward's grid ends after the q blocks with a live block
    (splash_kernels.forward's q_blocks); the others are never written: NaN in interpret mode,
    whatever the memory held on TPU. Made finite garbage here, as it can be on TPU, they must
    still count for nothing: the ring stays exact."""
    from longctx.ops import splash_kernels
    forward = splash_kernels.forward
    unwritten = []

    def forward_leaving_garbage(*args, **kwargs):
        out, lse = forward(*args, **kwargs)
        jax.debug.callback(lambda n: unwritten.append(int(n)), jnp.isnan(lse).sum())
        return jnp.where(jnp.isnan(out), 7.0, out), jnp.where(jnp.isnan(lse), 3.0, lse)

    monkeypatch.setattr(splash_kernels, "forward", forward_leaving_garbage)
    _ring_program.cache_clear()  # trace anew, with the patch
    try:
        _check(impl="splash", layout="zigzag", mask="causal", with_seg=True, kv_heads=2,
               with_aux=False, soft_cap=None)
    finally:
        _ring_program.cache_clear()
    assert sum(unwritten) > 0, "no q block was left unwalked: the test tests nothing"


def _steps_visited_on_device(layout, seg, sp=4):
    """What ring._steps_to_visit answers on every device of a (fsdp=2, sp) mesh, one row of the
    natural-order ids `seg` [2, S] per ring."""
    from longctx.ops import ring as ring_lib
    from longctx.ops import tables

    perm = layout_lib.permutation(layout, seg.shape[1], sp)
    q = jnp.zeros((seg.shape[0], seg.shape[1], 1, 128), jnp.float32)

    def per_shard(q, seg):
        cfg, q_ids, kv_ids, _ = ring_lib.prepare(q, q, q, seg, None, None, causal=True,
                                                  layout=layout, impl="xla", block_sizes=BLOCK)
        stop = ring_lib._stop(cfg, jax.lax.axis_index("sp"),
                              tables.document_ranges(q_ids, cfg.bq), kv_ids)
        return stop[None, None]

    data = P(("dp", "fsdp"), "sp")
    f = jax.shard_map(per_shard, mesh=_mesh(sp, 2), in_specs=(data, data), out_specs=data)
    return np.asarray(jax.jit(f)(q[:, perm], jnp.asarray(seg)[:, perm]))


@pytest.mark.parametrize("layout,case", [
    ("contiguous", "documents_inside_shards"), ("contiguous", "random"),
    ("contiguous", "one_document_everywhere"), ("contiguous", "padding_rows"),
    ("contiguous", "all_padding"), ("contiguous", "rings_that_differ"),
    ("contiguous", "documents_across_one_edge"), ("zigzag", "random"),
    ("striped", "documents_inside_shards"),
])
def test_ring_stops_after_the_last_step_with_a_live_block(layout, case):
    """With documents the ring visits its steps only up to the last one at which some device
    has a live block, over every row of the batch: what the host schedule (the report's,
    tables.document_schedule) calls its visited steps. Every device of the mesh agrees, also
    across rings (here one row per ring): a ring that stopped earlier than another would leave
    the other's collectives waiting."""
    from longctx.ops import masks, tables

    sp, seq_len = 4, SHARD * 4
    if case == "random":
        seg = _segments(np.random.default_rng(5), 2, seq_len)
    elif case == "all_padding":
        seg = np.zeros((2, seq_len), np.int32)
    elif case == "rings_that_differ":  # one ring needs one step, the other more
        seg = np.stack([_edge_documents("documents_inside_shards", batch=1)[0],
                        _segments(np.random.default_rng(5), 1, seq_len)[0]])
    else:
        seg = _edge_documents(case, batch=2)
    visited = _steps_visited_on_device(layout, seg, sp)
    spec = masks.make_mask_spec(True, None, None)

    def want(rows):
        return len(tables.document_schedule(spec, layout, seq_len, sp, BLOCK, rows).visited_steps)

    assert (visited == want(seg)).all(), (visited, want(seg))
    if case in ("documents_inside_shards", "all_padding") and layout == "contiguous":
        assert want(seg) == 1  # no K/V ever leaves its device
    if case == "documents_across_one_edge" and layout == "contiguous":
        assert want(seg) == 2
    if case == "one_document_everywhere":
        assert want(seg) == sp
    if case == "rings_that_differ":
        assert want(seg[:1]) == 1 < want(seg[1:])


@pytest.mark.parametrize("case", ["documents_inside_shards", "one_document_everywhere"])
def test_two_device_ring_stopping_early_or_not(case):
    """sp=2, where the early stop is a cond, not a loop: exact when the ring stops after its
    first step (no document crosses a shard) and when it takes both."""
    segments = _edge_documents(case, batch=4, seq_len=SHARD * 2)
    assert _steps_visited_on_device("contiguous", segments[:2], sp=2).max() == (
        1 if case == "documents_inside_shards" else 2)
    _check(impl="xla", layout="contiguous", mask="causal", with_seg=True, kv_heads=2,
           with_aux=False, soft_cap=None, sp=2, segments=segments)


def test_auto_layout_is_what_the_data_pipeline_is_told():
    assert resolve_layout("auto", SHARD * 4, 4, causal=True) == "zigzag"
    _check(impl="xla", layout="auto", mask="causal", with_seg=True, kv_heads=2, with_aux=True,
           soft_cap=None)


def test_an_unbounded_two_sided_window_is_full_attention():
    """sliding_window=(2**31 - 1, 2**31 - 1), a window meant as "unbounded", attends as no window
    does (pos + window wrapped past int32 on device, and every query lost its keys)."""
    seq_len, batch = SHARD * 4, 4
    q, k, v, seg, aux, dout = _inputs(3, batch, seq_len, 2)
    huge = (("sliding_window", (2**31 - 1, 2**31 - 1)),)
    ring = _ring_program(4, 2, seq_len, "contiguous", "xla", huge, None, False, False)
    out, grads = ring(q, k, v, None, None, None, dout)
    ref_out, ref_grads = _ref_program((), None)(q, k, v, None, None, None, dout)
    oracle.assert_matches_reference(out, grads, ref_out, ref_grads, FWD_TOL, GRAD_TOL)


def test_a_chunk_past_int32_is_one_chunk_per_document():
    """chunk_size=2**31 with documents: every document is one chunk (causal within documents);
    the chunk ids' `position % chunk` overflowed int32 inside jit."""
    seq_len, batch = SHARD * 4, 4
    q, k, v, seg, aux, dout = _inputs(4, batch, seq_len, 2)
    causal = (("causal", True),)
    ring = _ring_program(4, 2, seq_len, "zigzag", "xla", causal + (("chunk_size", 2**31),), None,
                         True, False)
    out, grads = ring(q, k, v, seg, None, None, dout)
    ref_out, ref_grads = _ref_program(causal, None)(q, k, v, seg, None, None, dout)
    oracle.assert_matches_reference(out, grads, ref_out, ref_grads, FWD_TOL, GRAD_TOL)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_fully_masked_rows_are_zero_and_finite(impl):
    """Queries whose segment has no key anywhere: output 0, gradients 0, no NaN/Inf."""
    sp, fsdp = 4, 2
    q, k, v, seg, aux, dout = _inputs(3, 2 * fsdp, SHARD * sp, 2)
    kv_seg = np.where(seg % 3 == 1, -1, seg).astype(np.int32)  # those queries match no key
    items = tuple(sorted(MASKS["causal"].items()))
    ring = _ring_program(sp, fsdp, SHARD * sp, "zigzag", impl, items, None, True, False,
                         kv_segments_differ=True)
    out, grads = ring(q, k, v, seg, kv_seg, None, dout)
    ref_out, ref_grads = _ref_program(items, None)(q, k, v, seg, kv_seg, None, dout)
    for x in (out, *grads[:3]):
        assert np.isfinite(np.asarray(x)).all()
    dead = np.broadcast_to((seg % 3 == 1)[:, :, None, None], out.shape)
    assert dead.any() and (np.asarray(out)[dead] == 0).all()
    np.testing.assert_allclose(out, ref_out, **FWD_TOL)
    for g, r in zip(grads[:3], ref_grads[:3]):
        np.testing.assert_allclose(g, r, **GRAD_TOL)


# bf16 rounding: an 8-bit significand rounded to nearest moves x by at most half an ulp, |dx| <= u|x|
# with u = 2^-8, and (uniform over the ulp) by a standard deviation of at most u|x|/sqrt(3).
BF16_U = 2.0 ** -8
# Each element may differ from the reference by Z_MAX standard deviations of its own rounding noise.
Z_MAX = 6.0


@functools.partial(jax.jit, static_argnames="mask_items")  # one program, not ~40 op by op
def _bf16_noise(qx, k, v, seg, aux, dout, ref_out, ref_grads, mask_items):
    """Per element of out, dq, dk, dv, dsinks: the standard deviation of the error that the ring's
    bf16 roundings cause, each rounding an independent error of sd <= u|x|/sqrt(3) carried to the
    result to first order (the float32 statistics and sums add ~2^-24 relative, ignored):

      p before p@v (forward) and p^T@do  -> var(out) += (u^2/3) sum_s p^2 v^2,  var(dv) likewise
      out to bf16, and D = sum_h do*out from it -> var(out) += (u^2/3) out^2, var(D) = sum_h do^2 var(out)
      ds = p (dP - D) before ds@k, ds^T@qx  -> (u^2/3) sum ds^2 k^2 (dq), sum ds^2 qx^2 (dk);
                                               D's error moves ds by -p dD
      each gradient to bf16                 -> (u^2/3) x^2
    Nothing for the ring steps' partial out, dq, dk and dv: both backends return them in float32
    (ops/splash_kernels.py), so a result is rounded once, as on one device.

    qx = bf16(q * scale) is what the ring multiplies (ops/ring.py pre-scales q in bf16), and the
    reference is given the same qx, so this rounding is not part of the comparison. The noise is
    a sum over an element's own terms: an element near zero with small terms is held tightly,
    whatever the largest value of its tensor. Dense float32 like the reference: p [b, k, g, t, s]."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    qx, k, v, aux, dout, ref_out = map(f32, (qx, k, v, aux, dout, ref_out))
    ref_dqx, ref_dk, ref_dv, ref_dsinks = map(f32, ref_grads)
    b, seq_len, heads, head_dim = qx.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    var = BF16_U ** 2 / 3  # per unit |x|^2
    five = lambda x: x.reshape(b, seq_len, kv_heads, groups, head_dim)
    q5, do5, out5 = five(qx), five(dout), five(ref_out)
    m = dict(mask_items)
    mask = reference_lib._dense_mask(seq_len, m.get("causal", False), m.get("sliding_window"),
                                     m.get("chunk_size"))[None] & (seg[:, :, None] == seg[:, None, :])
    logits = jnp.where(mask[:, None, None], jnp.einsum("btkgh,bskh->bkgts", q5, k), -jnp.inf)
    sink = jnp.broadcast_to(aux.reshape(1, kv_heads, groups, 1, 1), (b, kv_heads, groups, seq_len, 1))
    z = jax.nn.logsumexp(jnp.concatenate([logits, sink], axis=-1), axis=-1, keepdims=True)
    p, p_sink = jnp.exp(logits - z), jnp.exp(sink - z)[..., 0]
    p2 = p * p
    d = jnp.einsum("btkgh,btkgh->bkgt", do5, out5)
    ds = p * (jnp.einsum("btkgh,bskh->bkgts", do5, v) - d[..., None])
    ds2 = ds * ds
    var_out = var * (jnp.einsum("bkgts,bskh->btkgh", p2, v * v) + out5 * out5)
    var_d = jnp.einsum("btkgh,btkgh->bkgt", do5 * do5, var_out)
    to_btkg = lambda x: jnp.moveaxis(x, 3, 1)[..., None]  # [b, k, g, t] -> [b, t, k, g, 1]
    var_dq = (var * (jnp.einsum("bkgts,bskh->btkgh", ds2, k * k) + five(ref_dqx) ** 2)
              + to_btkg(var_d) * jnp.einsum("bkgts,bskh->btkgh", p, k) ** 2)
    var_dk = (var * (jnp.einsum("bkgts,btkgh->bskh", ds2, q5 * q5) + ref_dk ** 2)
              + jnp.einsum("bkgts,btkgh->bskh", p2 * var_d[..., None], q5 * q5))
    var_dv = var * (jnp.einsum("bkgts,btkgh->bskh", p2, do5 * do5) + ref_dv ** 2)
    var_dsinks = jnp.einsum("bkgt,bkgt->kg", p_sink ** 2, var_d).reshape(heads) + var * ref_dsinks ** 2
    sd = lambda x, shape=None: jnp.sqrt(x if shape is None else x.reshape(shape))
    return {"out": sd(var_out, qx.shape), "dqx": sd(var_dq, qx.shape), "dk": sd(var_dk), "dv": sd(var_dv),
            "dsinks": sd(var_dsinks)}


def _assert_within_noise(name, x, ref, sd):
    """|x - ref| <= Z_MAX sd, element by element; names the worst element if not."""
    x, ref, sd = (np.asarray(a, np.float64) for a in (x, ref, sd))
    z = np.abs(x - ref) / np.maximum(sd, np.finfo(np.float32).tiny)
    worst = np.unravel_index(np.argmax(z), z.shape)
    assert z.max() <= Z_MAX, (f"{name}: {(z > Z_MAX).sum()} of {z.size} elements beyond {Z_MAX:g} sd of bf16 "
                              f"rounding; worst at {worst}: got {x[worst]:.6g}, want {ref[worst]:.6g} "
                              f"({z[worst]:.1f} sd of {sd[worst]:.3g})")


@functools.lru_cache(maxsize=None)
def _ref_program_prescaled(mask_items):
    """The reference on q already multiplied by the softmax scale (softmax_scale=1)."""
    ref = functools.partial(reference_attention, softmax_scale=1.0, **dict(mask_items))
    return jax.jit(functools.partial(_out_and_grads, ref))


@pytest.mark.parametrize("impl,sp", [("xla", 4), ("splash", 4), ("splash", 1)])
def test_bfloat16_inputs(impl, sp):
    """bf16 in, bf16 out, float32 statistics: every element within rounding noise of the float32
    reference on the same bf16 values, the noise computed per element from its own terms. At
    sp=1 the splash backward's kernel rounds dK, dV itself (a ring of one step)."""
    fsdp = 2
    q, k, v, seg, aux, dout = _inputs(5, 2 * fsdp, SHARD * sp, 2, dtype=jnp.bfloat16)
    items = tuple(sorted(MASKS["causal"].items()))
    out, grads = _ring_program(sp, fsdp, SHARD * sp, "zigzag", impl, items, None, True, True)(
        q, k, v, seg, None, aux, dout)
    assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    scale = HEAD_DIM ** -0.5
    qx = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16)  # as ops/ring.py pre-scales q
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    ref_out, ref_grads = _ref_program_prescaled(items)(*f32(qx, k, v), seg, None, *f32(aux, dout))
    sd = _bf16_noise(qx, k, v, seg, aux, dout, ref_out, ref_grads, mask_items=items)
    # d/dq = scale * d/dqx (the rounding of q * scale passes the gradient straight through)
    ref_dq = ref_grads[0] * scale
    for name, x, r, s in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, ref_dq, *ref_grads[1:]),
                             (sd["out"], sd["dqx"] * scale, sd["dk"], sd["dv"], sd["dsinks"])):
        _assert_within_noise(name, x, r, s)


def _jaxpr(sp, impl="xla", seq_len=None, **mask):
    """Jaxpr of the ring (forward + backward) on a sp-device mesh, traced only."""
    seq_len = seq_len or SHARD * sp
    mesh = _mesh(sp, 1)
    data = P(None, "sp")
    q = jax.ShapeDtypeStruct((1, seq_len, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq_len, 2, HEAD_DIM), jnp.float32)
    f = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, impl=impl, block_sizes=BLOCK, **mask),
                      mesh=mesh, in_specs=(data,) * 3, out_specs=data)
    return jax.make_jaxpr(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))(q, kv, kv)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of all its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else _subs(eqn):
            yield from _eqns(sub)


def _count(jaxpr, prim=None):
    """Equations in a jaxpr and all its sub-jaxprs (optionally only those of one primitive)."""
    return sum(prim is None or eqn.primitive.name == prim for eqn in _eqns(jaxpr))


def _subs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "jaxpr"):
                yield x.jaxpr if hasattr(x.jaxpr, "eqns") else x.jaxpr.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def test_ring_is_a_loop_program_size_does_not_grow_with_sp():
    sizes = {sp: _count(_jaxpr(sp, causal=True).jaxpr) for sp in (2, 4, 8)}
    assert sizes[2] == sizes[4] == sizes[8], sizes


def _constant_elements(impl, shard, block, sp=4):
    """Elements of every constant in the lowered ring (forward + backward, causal, documents)."""
    import re

    mesh, data = _mesh(sp, 1), P(None, "sp")
    q = jax.ShapeDtypeStruct((1, shard * sp, 2, 128), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, shard * sp), jnp.int32)
    f = jax.shard_map(lambda q, k, v, s: ring_attention(q, k, v, s, impl=impl, block_sizes=block,
                                                        causal=True, layout="zigzag"),
                      mesh=mesh, in_specs=(data,) * 4, out_specs=data)
    text = jax.jit(jax.grad(lambda q, k, v, s: f(q, k, v, s).sum(), argnums=(0, 1, 2))).lower(
        q, q, q, seg).as_text()
    return [int(np.prod([int(d) for d in shape.split("x")[:-1]] or [1]))
            for shape in re.findall(r"stablehlo\.constant dense<.*?> : tensor<([^>]*)>", text)]


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_the_program_holds_no_block_table(impl):
    """Each device builds its own step's block tables (ops/tables.py), so the program's
    constants (a partial block's pattern, a few numbers per block of a shard) grow at most
    linearly with the blocks of a shard, never with the (q block, kv block) pairs: from 8 to 32
    blocks per shard, at most 64 more elements per added block (measured: xla 12, splash 52;
    each copy of a ring step in the program has its own). Tables built on the host for every
    device hold sp x steps x (L / block)^2 entries (here +51,264 elements, 2,136 per added
    block) and grow to hundreds of MiB at 2M tokens."""
    small, large = (sum(_constant_elements(impl, shard, 128)) for shard in (1024, 4096))
    assert large - small <= 64 * (32 - 8), (small, large)


def test_pruned_rings_send_nothing_they_do_not_need():
    # chunks that never cross a shard: one ring step, no K/V transfer at all
    assert _count(_jaxpr(4, chunk_size=SHARD).jaxpr, "ppermute") == 0
    full = _count(_jaxpr(4, causal=True).jaxpr, "ppermute")
    window = _count(_jaxpr(4, causal=True, sliding_window=SHARD // 2).jaxpr, "ppermute")
    assert 0 < window <= full


def _trace(q_shape=(2, 1024, 4, 32), kv_shape=(2, 1024, 2, 32), sp=4, seg_shape=None,
           aux_shape=None, **kw):
    mesh = _mesh(sp, 1)
    data = P(None, "sp")
    sds = lambda s, dt=jnp.float32: None if s is None else jax.ShapeDtypeStruct(s, dt)
    args = (sds(q_shape), sds(kv_shape), sds(kv_shape), sds(seg_shape, jnp.int32), sds(aux_shape))
    specs = (data, data, data, None if seg_shape is None else data,
             None if aux_shape is None else P())
    f = jax.shard_map(lambda q, k, v, s, a: ring_attention(q, k, v, s, None, a, **kw),
                      mesh=mesh, in_specs=specs, out_specs=data)
    return jax.eval_shape(f, *args)


def test_bad_input_names_the_argument_and_the_numbers():
    with pytest.raises(ValueError, match=r"heads=4 is not divisible by .*kv_heads=3"):
        _trace(kv_shape=(2, 1024, 3, 32))
    with pytest.raises(ValueError, match=r"impl='cuda'"):
        _trace(impl="cuda")
    with pytest.raises(ValueError, match=r"layout='spiral'"):
        _trace(layout="spiral")
    with pytest.raises(ValueError, match=r"sliding_window=-5 must be non-negative"):
        _trace(sliding_window=-5)
    with pytest.raises(ValueError, match=r"q_segment_ids has shape \(2, 100\), expected .*\(2, 256\)"):
        _trace(seg_shape=(2, 400))
    with pytest.raises(ValueError, match=r"softmax_aux has shape \(3,\), expected \(heads,\) = \(4,\)"):
        _trace(aux_shape=(3,))
    with pytest.raises(ValueError, match=r"block_q=96 does not divide the shard length L=256"):
        _trace(block_sizes=96, impl="xla")
    with pytest.raises(ValueError, match=r"block_q=64 must be a multiple of 128 for impl='splash'"):
        _trace(block_sizes=64)
    with pytest.raises(ValueError, match=r"seq_len=1004 is not divisible by 8 \(2\*num_shards"):
        _trace(q_shape=(2, 1004, 4, 32), kv_shape=(2, 1004, 2, 32), layout="zigzag", impl="xla",
               block_sizes=251)
    with pytest.raises(ValueError, match=r"axis_name='ring' is not bound"):
        _trace(axis_name="ring")
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    with pytest.raises(ValueError, match=r"use_fused_bwd_kernel=False: the ring's backward is one"):
        _trace(block_sizes=sk.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128,
                                         use_fused_bwd_kernel=False))


@pytest.mark.parametrize("block,compute", [(128, 128), (512, 512), (1024, 512), (2048, 512),
                                           (384, 384), (640, 640)])
def test_a_block_computes_up_to_512_keys_at_a_time(block, compute):
    """The forward and the backward multiply up to 512 keys at once, a whole block where 512 does
    not divide it (a compute block must divide its block)."""
    from longctx.ops import ring as ring_lib
    assert ring_lib.compute_block(block) == compute
    assert ring_lib._block_sizes(block, 4 * block, "splash", "contiguous") == (
        block, block, compute, compute)


@pytest.mark.parametrize("impl", ["splash"])  # the kernel's local shard_map must survive re-tracing
def test_under_remat_and_scan_like_the_model(impl):
    """Layers as lax.scan over jax.checkpoint, each calling the ring in a shard_map (re-traced)."""
    sp, fsdp = 4, 2
    seq_len = SHARD * sp
    q, k, v, seg, aux, dout = _inputs(7, 2 * fsdp, seq_len, 2)
    mesh, data = _mesh(sp, fsdp), P(("dp", "fsdp"), "sp")
    ring = jax.shard_map(
        lambda q, k, v, s, a: ring_attention(q, k, v, s, None, a, causal=True, impl=impl,
                                             block_sizes=BLOCK),
        mesh=mesh, in_specs=(data, data, data, data, P()), out_specs=data)
    ref = lambda q, k, v, s, a: reference_attention(q, k, v, s, None, a, causal=True)

    def two_layers(attn, q, k, v, aux):
        layer = jax.checkpoint(lambda x, _: (attn(x, k, v, seg, aux), None))
        return jax.lax.scan(layer, q, None, length=2)[0]

    run = lambda attn: jax.jit(functools.partial(
        _out_and_grads, lambda q, k, v, qs, ks, a: two_layers(attn, q, k, v, a)))(
            q, k, v, None, None, aux, dout)
    got, want = run(ring), run(ref)
    np.testing.assert_allclose(got[0], want[0], **FWD_TOL)
    for g, r in zip(got[1], want[1]):
        np.testing.assert_allclose(g, r, **GRAD_TOL)


def _pallas_outputs(jaxpr):
    """(kernel name, output dtypes) of every pallas_call in a jaxpr and its sub-jaxprs."""
    return [(str(eqn.params["name"]), tuple(v.aval.dtype for v in eqn.outvars))
            for eqn in _eqns(jaxpr) if eqn.primitive.name == "pallas_call"]


@pytest.mark.parametrize("sp", [1, 2])
def test_a_ring_of_one_step_has_its_backward_kernel_round_dk_dv(sp):
    """With one step nothing is added to the step's dK and dV, so the kernel writes them in K/V's
    dtype (half the bytes of float32, written and then read again to round them); a ring of
    more steps keeps them float32 to sum its steps. Their values: test_bfloat16_inputs."""
    mesh, data = _mesh(sp, 1), P(None, "sp")
    q = jax.ShapeDtypeStruct((1, SHARD * sp, HEADS, HEAD_DIM), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, SHARD * sp, 2, HEAD_DIM), jnp.bfloat16)
    def attend(q, k, v):
        return ring_attention(q, k, v, impl="splash", block_sizes=BLOCK, causal=True)

    f = jax.shard_map(attend, mesh=mesh, in_specs=(data,) * 3, out_specs=data)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2)))(q, kv, kv)
    backward = [dtypes for name, dtypes in _pallas_outputs(jaxpr.jaxpr) if "bwd" in name]
    assert backward, "no backward kernel found"
    dkv = jnp.bfloat16 if sp == 1 else jnp.float32
    assert all(dtypes == (jnp.float32, dkv, dkv) for dtypes in backward), backward


def _selects_of_shape(jaxpr, shape, dtype):
    """select_n equations (in a jaxpr and its sub-jaxprs) whose output has `shape` and `dtype`."""
    return sum(eqn.primitive.name == "select_n" and eqn.outvars[0].aval.shape == shape
               and eqn.outvars[0].aval.dtype == dtype for eqn in _eqns(jaxpr))


@pytest.mark.parametrize("documents", [False, True])
def test_a_ring_of_one_step_without_documents_keeps_every_row_of_its_forward(documents):
    """On one step every query sees itself (MaskSpec.bounds holds the position), so without
    documents (no padding) every row of the forward kernel's output is computed and none needs
    emptying: no pass over the float32 output selects rows. With documents a padded row has no
    key, so its row is emptied."""
    mesh, data = _mesh(1, 1), P(None, "sp")
    q = jax.ShapeDtypeStruct((1, SHARD, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, SHARD, 2, HEAD_DIM), jnp.float32)
    seg = (jax.ShapeDtypeStruct((1, SHARD), jnp.int32),) if documents else ()
    def attend(q, k, v, *s):
        return ring_attention(q, k, v, *s, impl="splash", block_sizes=BLOCK, causal=True)

    f = jax.shard_map(attend, mesh=mesh, in_specs=(data,) * (3 + len(seg)), out_specs=data)
    jaxpr = jax.make_jaxpr(f)(q, kv, kv, *seg)
    selects = _selects_of_shape(jaxpr.jaxpr, (1, HEADS, SHARD, HEAD_DIM), jnp.float32)
    assert (selects > 0) == documents, selects


def _pallas_inputs(jaxpr, kernel):
    """(shape, dtype) of each input of every pallas_call named `kernel` in a jaxpr."""
    return [[(tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars] for eqn in _eqns(jaxpr)
            if eqn.primitive.name == "pallas_call" and str(eqn.params["name"]) == kernel]


@pytest.mark.parametrize("sp", [1, 2])
def test_a_ring_of_one_step_gives_its_sinks_to_the_forward_kernel(sp):
    """A ring of one step has no accumulator to start from the sinks, so its forward kernel
    takes them ([8, heads] float32, as splash's): the output is then one division by a sum of
    the kernel's own exponentials, as stock splash's is (on a v5e in float32, adding the sinks
    afterwards from the kernel's logsumexp was 150x less accurate than stock splash). A ring of
    more steps starts its float32 merge from them and its kernels take none. Their values:
    test_bfloat16_inputs and test_other_ring_sizes (sp=1), the oracle tests (sp > 1)."""
    mesh, data = _mesh(sp, 1), P(None, "sp")
    q = jax.ShapeDtypeStruct((1, SHARD * sp, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, SHARD * sp, 2, HEAD_DIM), jnp.float32)
    sinks = jax.ShapeDtypeStruct((HEADS,), jnp.float32)

    def attend(q, k, v, sinks):
        return ring_attention(q, k, v, None, None, sinks, impl="splash", block_sizes=BLOCK,
                              causal=True)

    f = jax.shard_map(attend, mesh=mesh, in_specs=(data,) * 3 + (P(),), out_specs=data)
    forward = _pallas_inputs(jax.make_jaxpr(f)(q, kv, kv, sinks).jaxpr, "longctx_attention_fwd")
    assert forward, "no forward kernel found"
    takes_sinks = [((8, HEADS), jnp.float32) in inputs for inputs in forward]
    assert takes_sinks == [sp == 1] * len(forward), (sp, takes_sinks)


def _kernels_under_cond(jaxpr):
    """pallas_calls inside a cond's branches, in a jaxpr and its sub-jaxprs."""
    return sum(_count(sub, "pallas_call") for eqn in _eqns(jaxpr) if eqn.primitive.name == "cond"
               for sub in _subs(eqn))


@pytest.mark.parametrize("sp", [1, 2])
def test_a_ring_of_one_step_with_documents_calls_its_kernels_unconditionally(sp):
    """With documents a ring of several steps skips a step that has no live block (a cond
    around its kernels); a ring of one step has no step to skip but one of padding only, which
    its kernels walk as an empty table, so it has no cond: on a TPU the cond kept copies of the
    kernels' float32 outputs (AOT for v5p, 32,768 tokens, 8 heads, blocks of 2,048: 640 MiB of
    temporaries against 383, and causal without documents 364). Values with documents at sp=1:
    test_bfloat16_inputs, test_other_ring_sizes and
    test_a_ring_of_one_step_whose_device_holds_only_padding."""
    mesh, data = _mesh(sp, 1), P(None, "sp")
    q = jax.ShapeDtypeStruct((1, SHARD * sp, HEADS, HEAD_DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, SHARD * sp, 2, HEAD_DIM), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, SHARD * sp), jnp.int32)

    def attend(q, k, v, seg):
        return ring_attention(q, k, v, seg, impl="splash", block_sizes=BLOCK, causal=True)

    f = jax.shard_map(attend, mesh=mesh, in_specs=(data,) * 4, out_specs=data)
    loss = lambda *a: f(*a).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv, seg).jaxpr
    assert _count(jaxpr, "pallas_call") >= 2
    assert (_kernels_under_cond(jaxpr) > 0) == (sp > 1), _kernels_under_cond(jaxpr)
