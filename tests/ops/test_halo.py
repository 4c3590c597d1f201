"""The halo strategy's plan (what each ring offset sends) against the dense mask, and its bytes
against the ring's in the lowered TPU program.

Exactness (forward and gradients against the dense reference, every mask and layout, documents,
sinks, soft cap, both kernels) is checked with the other strategies: tests/ops/test_context_parallel.py.
"""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from longctx.ops import halo, masks
from longctx.parallel import layout as layout_lib
from longctx.plan import aot, collectives

SEQ_LEN, SP, BLOCK = 1024, 4, 64


def _keeps(q, k, window, chunk):
    """The dense mask on global positions q [n, 1], k [1, m], written out: causal, a causal window
    (left) or chunked causal."""
    keep = k <= q
    if window is not None:
        keep &= k >= q - window
    if chunk is not None:
        keep &= k // chunk == q // chunk
    return keep


@pytest.mark.parametrize("layout", layout_lib.LAYOUTS)
@pytest.mark.parametrize("window, chunk", [(100, None), (300, None), (None, 256), (None, 384),
                                           (None, None), (50, 384)])
def test_each_exchange_sends_the_hull_of_the_blocks_some_query_reaches(layout, window, chunk):
    spec = masks.make_mask_spec(True, None if window is None else (window, 0), chunk)
    got = {ex.offset: ex for ex in halo.plan(spec, layout, SEQ_LEN, SP, BLOCK, BLOCK)}
    positions = layout_lib.shard_positions(layout, SEQ_LEN, SP)  # [shard, slot] global positions
    for offset in range(1, SP):
        reached = np.zeros(SEQ_LEN // SP // BLOCK, bool)  # K/V blocks of the shard `offset` back
        receivers = []
        for a in range(SP):
            keep = _keeps(positions[a][:, None], positions[(a - offset) % SP][None, :], window, chunk)
            if keep.any():
                receivers.append(a)
                reached |= keep.reshape(keep.shape[0], -1, BLOCK).any(axis=(0, 2))
        if not receivers:
            assert offset not in got
            continue
        blocks = np.flatnonzero(reached)
        assert (got[offset].start, got[offset].stop) == (blocks[0] * BLOCK, (blocks[-1] + 1) * BLOCK)
        assert got[offset].perm == tuple(((a - offset) % SP, a) for a in receivers)


def test_a_window_sends_its_halo_and_chunks_inside_shards_send_nothing():
    """Gemma 3's local layer at 131,072 tokens over sp = 16 (window 1,024, blocks of 512): the
    ring sends a whole 8,192-token shard one hop; the halo sends 2 blocks. In zigzag each shard's
    two chunks take a halo from each neighbour. A chunk of one shard needs nothing (without
    documents)."""
    def plan(layout, window=None, chunk=None):
        spec = masks.make_mask_spec(True, None if window is None else (window, 0), chunk)
        return [(ex.offset, ex.stop - ex.start) for ex in halo.plan(spec, layout, 131072, 16, 512, 512)]

    assert plan("contiguous", window=1024) == [(1, 1024)]
    assert plan("zigzag", window=1024) == [(1, 1024), (15, 1024)]
    assert plan("contiguous", chunk=8192) == []
    assert plan("contiguous", chunk=16384) == [(1, 8192)]  # a chunk over two shards: its first one
    # With documents a chunk starts at each document's start: statically, a causal window of
    # chunk - 1 keys (masks.within_chunk_window, what the kernels are given), so up to a shard.
    documents = masks.within_chunk_window(masks.make_mask_spec(True, None, 8192))
    assert [(ex.offset, ex.stop - ex.start)
            for ex in halo.plan(documents, "contiguous", 131072, 16, 512, 512)] == [(1, 8192)]


@pytest.mark.tpu_aot
@pytest.mark.skipif(not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra)")
def test_a_gemma_3_local_layer_sends_at_most_a_quarter_of_the_ring_s_bytes_on_v5p():
    """Read from the lowered programs for v5p:2x2x4 (16 chips on sp; nothing compiles): Gemma-3-12B's
    attention shape (16 heads, 8 KV heads of 256, bf16) at 131,072 tokens with documents, window
    1,024, forward and backward. A chunked layer with chunk = shard sends nothing without documents
    (with them, chunks start at each document's start: test_a_window_sends_its_halo_...)."""
    devices = aot.topology_devices("v5p:2x2x4")
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",), axis_types=(AxisType.Auto,))
    shape = collectives.Shape(batch=1, seq_len=131072, sp=16, heads=16, kv_heads=8, head_dim=256,
                              dtype_bytes=2, documents=True)
    common = dict(impl="splash", layout="contiguous", block_sizes=512, skip_documents=False, causal=True)
    sent = {strategy: collectives.attention_traffic(mesh, shape, strategy, sliding_window=(1024, 0),
                                                    **common)
            for strategy in ("ring", "halo")}
    for part in ("forward", "backward"):
        ring, local = sent["ring"][part].total_sent, sent["halo"][part].total_sent
        assert sent["halo"][part].unknown_loops == 0
        assert 0 < local <= ring / 4, (part, local, ring)
    assert sent["halo"]["forward"].total_sent == collectives.formula(
        "halo", shape, sliding_window=(1024, 0), block=512)["forward"]
    # (without documents: chunks then count from the row's start, which attention_traffic gives)
    chunked = collectives.attention_traffic(mesh, dataclasses.replace(shape, documents=False), "halo",
                                            chunk_size=8192, **common)
    assert chunked["forward"].total_sent == chunked["backward"].total_sent == 0
