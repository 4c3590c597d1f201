"""MFU's numerator: kept (query, key) pairs and FLOPs per step, against counts done by hand."""

import ml_collections
import numpy as np
import pytest

from configs import base
from longctx.model import attention as attention_lib
from longctx.model import flops
from longctx.ops import masks
from tests import synthetic


@pytest.mark.parametrize("mask, expected", [
    # S = 8, counted row by row (row i keeps ...):
    (dict(causal=False, sliding_window=None, chunk_size=None), 64),  # all 8
    (dict(causal=True, sliding_window=None, chunk_size=None), 36),   # 1 + 2 + ... + 8
    # keys [i - 2, i]: 1, 2, 3, 3, 3, 3, 3, 3; the window is one-sided with or without causal
    (dict(causal=True, sliding_window=2, chunk_size=None), 21),
    (dict(causal=False, sliding_window=2, chunk_size=None), 21),
    # chunks [0, 3), [3, 6), [6, 8): (1 + 2 + 3) + (1 + 2 + 3) + (1 + 2)
    (dict(causal=True, sliding_window=None, chunk_size=3), 15),
    # both: chunk 3 and window 1: 1, 2, 2, 1, 2, 2, 1, 2
    (dict(causal=True, sliding_window=1, chunk_size=3), 13),
])
def test_kept_pairs_by_hand(mask, expected):
    assert flops.kept_pairs(8, **mask) == expected
    # ... and the same as the mask the ring applies (config keys -> ring keywords -> dense mask).
    attention = attention_lib.mask_kwargs(ml_collections.ConfigDict(mask))
    spec = masks.make_mask_spec(**attention)
    pos = np.arange(8)
    assert int(spec.allowed(pos[:, None], pos[None, :]).sum()) == expected


def test_flops_per_step_by_hand():
    c = base.get_config("tiny")
    c.unlock()
    c.model.update(vocab_size=10, d_model=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=3,
                   mlp_dim=5)
    c.data.update(seq_len=8, global_batch_size=3)
    c.attention.update(causal=True, sliding_window=2, chunk_size=None)
    # Per token per layer: q, k, v, o = 4*3*(2+1+1+2) = 72 weights; MLP 3*4*5 = 60; unembedding 4*10.
    # 2 FLOPs per weight per token, 24 tokens: 2*24*(2*132 + 40) = 14,592.
    # Attention: 21 kept pairs (above) x 3 rows x 2 layers x 2 heads x head_dim 3 x 4 FLOPs = 3,024.
    # Training = 3 x forward.
    assert flops.flops_per_step(c) == 3 * (14_592 + 3_024)


@pytest.mark.parametrize("remat, residuals, expected", [
    # Per token per layer: q/k/v projections 4*3*(2+1+1) = 48 weights, output projection + MLP
    # 4*3*2 + 3*4*5 = 84; 2 FLOPs per weight, 24 tokens, 2 layers.
    ("none", "save_qkv", 0),
    ("dots_saveable", "save_qkv", 0),
    ("nothing_saveable", "save_qkv", 2 * 24 * 2 * (48 + 84)),
    ("none", "recompute_qkv", 2 * 24 * 2 * (48 + 84)),  # the layer's VJP reruns all but the ring
    ("nothing_saveable", "recompute_qkv", 2 * 24 * 2 * (48 + 84)),
    ("nothing_saveable", "offload_qkv", 2 * 24 * 2 * 84),  # q, k, v come back from the host
])
def test_recomputed_flops_by_hand(remat, residuals, expected):
    c = base.get_config("tiny")
    c.model.update(vocab_size=10, d_model=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=3,
                   mlp_dim=5, remat_policy=remat)
    c.data.update(seq_len=8, global_batch_size=3)
    c.attention.residuals = residuals
    assert flops.recomputed_flops_per_step(c) == expected
    # MFU's count is the same for every setting: recomputation is never credited
    model_flops = flops.flops_per_step(c)
    c.model.remat_policy, c.attention.residuals = "none", "save_qkv"
    assert flops.flops_per_step(c) == model_flops


# ----------------------------------------------------------------------------- documents


def _dense_kept(segment_ids, positions, *, causal, sliding_window, chunk_size) -> int:
    """The kept pairs of rows of packed documents, from the mask's definition on dense [S, S]
    grids: a query sees keys of its own document (id > 0) only, at in-document positions p_i, p_j
    with p_j <= p_i (causal, a window, chunks), p_i - p_j <= w (window), in one chunk (chunks
    count from the document's start)."""
    total = 0
    for ids, pos in zip(np.asarray(segment_ids), np.asarray(positions)):
        qi, kj = pos[:, None], pos[None, :]
        keep = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0)
        if causal or sliding_window is not None or chunk_size is not None:
            keep &= kj <= qi
        if sliding_window is not None:
            keep &= qi - kj <= sliding_window
        if chunk_size is not None:
            keep &= qi // chunk_size == kj // chunk_size
        total += int(keep.sum())
    return total


MASKS = {"full": dict(causal=False, sliding_window=None, chunk_size=None),
         "causal": dict(causal=True, sliding_window=None, chunk_size=None),
         "window": dict(causal=True, sliding_window=37, chunk_size=None),
         "chunk": dict(causal=True, sliding_window=None, chunk_size=48),
         "window_in_chunks": dict(causal=True, sliding_window=13, chunk_size=48)}


@pytest.mark.parametrize("mask", MASKS)
def test_pairs_in_documents_against_a_dense_mask(mask):
    """Rows of random documents (some of one token, some longer than the window and chunks, a
    padded tail), counted in closed form and pair by pair; in the sp layout's token order too."""
    rows = synthetic.packed_rows(3, 384, 97, seed=11, mean_doc_len=70)
    want = _dense_kept(rows["segment_ids"], rows["positions"], **MASKS[mask])
    lengths = flops.document_lengths(rows["segment_ids"])
    assert flops.pairs_in_documents(lengths, **MASKS[mask]) == want
    zigzag = synthetic.to_layout(rows, "zigzag", 4)["segment_ids"]
    np.testing.assert_array_equal(np.sort(flops.document_lengths(zigzag)), np.sort(lengths))
    # one document per row: the whole row's count
    whole = np.ones((1, 384), np.int32)
    assert flops.kept_pairs(384, **MASKS[mask]) == _dense_kept(whole, np.arange(384)[None], **MASKS[mask])


def _config(**attention):
    c = base.get_config("tiny")
    c.model.update(num_layers=2, num_heads=2, head_dim=3)
    c.data.update(seq_len=384, global_batch_size=3)
    c.attention.update(**attention)
    return c


def test_a_batch_of_documents_counts_its_own_pairs():
    """MFU of the work the mask needs: a batch of documents counts its same-document causal pairs,
    a fraction of the rows' (a packed row credited with the whole row's causal attention read
    high); without segment ids each row is one document, whatever the batch holds."""
    rows = synthetic.packed_rows(3, 384, 97, seed=11, mean_doc_len=70)
    c = _config(causal=True)
    per_layer = _dense_kept(rows["segment_ids"], rows["positions"], **MASKS["causal"])
    assert flops.attention_pairs(c, rows["segment_ids"]) == 2 * per_layer
    assert flops.attention_pairs(c) == 2 * 3 * 384 * 385 // 2 > 4 * 2 * per_layer
    assert flops.flops_per_step(c, 2 * per_layer) == (flops.dense_flops_per_step(c)
                                                      + 3 * 4 * 2 * 3 * 2 * per_layer)
    assert flops.attention_convention(c) == "causal pairs within documents"
    c.attention.use_segment_ids = False
    assert flops.attention_pairs(c, rows["segment_ids"]) == flops.attention_pairs(c)
    assert flops.attention_convention(c) == "causal pairs of whole rows"


def test_each_layer_type_counts_its_own_mask_within_documents():
    rows = synthetic.packed_rows(2, 384, 97, seed=3, mean_doc_len=90)
    c = _config(causal=True, pattern="local,global")
    c.model.num_layers = 3  # local, global, local
    c.attention.layer_types = ml_collections.ConfigDict({"local": dict(sliding_window=37), "global": {}})
    local = _dense_kept(rows["segment_ids"], rows["positions"], **MASKS["window"])
    full = _dense_kept(rows["segment_ids"], rows["positions"], **MASKS["causal"])
    assert flops.attention_pairs(c, rows["segment_ids"]) == 2 * local + full
    assert flops.attention_convention(c) == "each layer type's mask's pairs within documents"
