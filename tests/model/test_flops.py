"""MFU's numerator: kept (query, key) pairs and FLOPs per step, against counts done by hand."""

import ml_collections
import numpy as np
import pytest

from configs import base
from longctx.model import attention as attention_lib
from longctx.model import flops
from longctx.ops import masks


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
