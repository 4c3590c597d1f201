"""ring_attention against the dense float32 reference: forward and grads of q, k, v, sinks.

Every configuration is one jit (forward + VJP) over a ("dp", "fsdp", "sp") mesh with batch
sharded over fsdp (2 rows per device), on natural-order inputs permuted into the layout and
back, so the test also checks the layout bookkeeping. impl="xla" covers every mask x every
layout, with segment ids / GQA / sinks / soft cap spread so that each mask and each layout sees
both values of each; impl="splash" (Pallas interpret mode, ~3x slower to compile) runs every
mask once across the layouts. Shapes: L = 256 per shard, block 128, head_dim 32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from longctx import layout as layout_lib
from longctx.ops import reference_attention, ring_attention

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
                  kv_segments_differ=False):
  mesh = _mesh(sp, fsdp)
  perm = layout_lib.permutation(layout if layout != "auto" else "contiguous", seq_len, sp)
  kw = dict(mask_items)
  data = P(("dp", "fsdp"), "sp")

  def per_shard(q, k, v, qs, ks, aux):
    return ring_attention(q, k, v, qs, ks, aux, logits_soft_cap=soft_cap, axis_name="sp",
                          layout=layout, impl=impl, block_sizes=BLOCK, **kw)

  def ring(q, k, v, qs, ks, aux):
    f = jax.shard_map(per_shard, mesh=mesh,
                      in_specs=(data, data, data, data if with_seg else None,
                                data if kv_segments_differ else None,
                                P() if with_aux else None),
                      out_specs=data)
    to_layout = lambda x: None if x is None else x[:, perm]
    out = f(*map(to_layout, (q, k, v, qs, ks)), aux)
    return out[:, layout_lib.inverse_permutation(perm)]

  return jax.jit(functools.partial(_out_and_grads, ring))


def _out_and_grads(fn, q, k, v, qs, ks, aux, dout):
  out, vjp = jax.vjp(lambda q, k, v, aux: fn(q, k, v, qs, ks, aux), q, k, v, aux)
  return out, vjp(dout)


@functools.lru_cache(maxsize=None)
def _ref_program(mask_items, soft_cap):
  ref = functools.partial(reference_attention, logits_soft_cap=soft_cap, **dict(mask_items))
  return jax.jit(functools.partial(_out_and_grads, ref))


def _check(*, impl, layout, mask, with_seg, kv_heads, with_aux, soft_cap, sp=4, fsdp=2,
           seed=0):
  seq_len, batch = SHARD * sp, 2 * fsdp
  q, k, v, seg, aux, dout = _inputs(seed, batch, seq_len, kv_heads)
  qs = seg if with_seg else None
  aux = aux if with_aux else None
  mask_items = tuple(sorted(MASKS[mask].items()))
  ring = _ring_program(sp, fsdp, seq_len, layout, impl, mask_items, soft_cap, with_seg, with_aux)
  out, grads = ring(q, k, v, qs, None, aux, dout)
  ref_out, ref_grads = _ref_program(mask_items, soft_cap)(q, k, v, qs, None, aux, dout)
  np.testing.assert_allclose(out, ref_out, **FWD_TOL, err_msg="output")
  for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
    if r is None:
      assert g is None
      continue
    np.testing.assert_allclose(g, r, **GRAD_TOL, err_msg=name)


XLA_CASES = []
for mi, mask in enumerate(MASKS):
  for li, lay in enumerate(layout_lib.LAYOUTS):
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


@pytest.mark.parametrize("impl,sp,fsdp,layout,mask", [
    ("xla", 1, 2, "contiguous", "causal"),
    ("xla", 8, 1, "striped", "causal_window"),
    ("xla", 8, 1, "zigzag", "chunked"),
    ("splash", 8, 1, "zigzag", "causal"),
])
def test_other_ring_sizes(impl, sp, fsdp, layout, mask):
  _check(impl=impl, layout=layout, mask=mask, with_seg=True, kv_heads=2, with_aux=True,
         soft_cap=None, sp=sp, fsdp=fsdp)


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


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_bfloat16_inputs(impl):
  """bf16 in, bf16 out, float32 statistics: within bf16 rounding of the float32 reference."""
  sp, fsdp = 4, 2
  q, k, v, seg, aux, dout = _inputs(5, 2 * fsdp, SHARD * sp, 2, dtype=jnp.bfloat16)
  items = tuple(sorted(MASKS["causal"].items()))
  out, grads = _ring_program(sp, fsdp, SHARD * sp, "zigzag", impl, items, None, True, True)(
      q, k, v, seg, None, aux, dout)
  f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
  ref_out, ref_grads = _ref_program(items, None)(*f32(q, k, v), seg, None, *f32(aux, dout))
  assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
  # bf16 has an 8-bit mantissa (relative step 2^-8 = 0.4%); allow a few roundings.
  for name, x, r in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref_out, *ref_grads)):
    err = np.abs(np.asarray(x, np.float32) - np.asarray(r))
    scale = np.abs(np.asarray(r)).max()
    assert err.max() <= 0.02 * scale, (name, err.max(), scale)
