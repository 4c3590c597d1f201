"""Model FLOPs per step and the chips' peak, for MFU.

Attention FLOPs count only the (query, key) pairs the static mask keeps — a causal or
sliding-window run must not look better than it is by being credited for blocks it never computes.
Documents are not subtracted: the count is that of a row holding one document. With packed
documents the ring skips the blocks no document needs, so the useful attention FLOPs are fewer
than counted and MFU reads high by up to the attention's share of the step (for a causal row of
many short documents, nearly all of it); `scripts/ring_report.py --doc-lengths` shows how many
blocks the documents keep. Chunked attention counts chunks from each document's start, as the
ring does with segment ids; on the row of one document that is the row's start, so the chunks
counted here are the row's (tests/evals/test_inference.py checks the two counts agree).

MFU counts model FLOPs only (`flops_per_step`: forward + backward of the model, 3x forward).
Work done twice is never credited: rematerialisation (`model.remat_policy`) and what
`attention.residuals=recompute_qkv` or `offload_qkv` runs again in the backward cost step time
but add nothing to the count, so a policy that recomputes shows its cost as a lower MFU.
`recomputed_flops_per_step` says how much extra work each setting does (hardware FLOPs =
model FLOPs + that).
"""

from __future__ import annotations

import numpy as np

from longctx.model import layer_types

# Dense bf16 peak per jax device, TFLOP/s (vendor figures): a chip, except on TPU7x, whose two
# TensorCores are two devices.
PEAK_TFLOPS_BY_CHIP = {
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5": 459.0,  # v5p reports its device_kind as "TPU v5"
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
    "TPU7x": 1153.5,  # Ironwood: one TensorCore, each a device (2,307 per chip of two)
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H200": 989.0,
}


def peak_tflops(device_kind: str, override: float | None = None) -> float | None:
    """The chip's peak, or None where it is unknown (MFU then reads "n/a")."""
    if override:
        return float(override)
    return PEAK_TFLOPS_BY_CHIP.get(device_kind)


def kept_pairs(seq_len: int, *, causal: bool, sliding_window: int | None, chunk_size: int | None) -> int:
    """Number of (i, j) pairs the mask keeps in one sequence, counted row by row in O(S).

    The masks are those of `longctx.model.attention.mask_kwargs`: `sliding_window=w` is one-sided (token i sees
    [i - w, i]) with or without `causal`, and `chunk_size` is chunked causal attention."""
    i = np.arange(seq_len, dtype=np.int64)
    lo = np.zeros_like(i)
    hi = i.copy() if causal else np.full_like(i, seq_len - 1)
    if sliding_window is not None:
        lo = np.maximum(lo, i - sliding_window)
        hi = np.minimum(hi, i)
    if chunk_size is not None:
        lo = np.maximum(lo, (i // chunk_size) * chunk_size)
    return int(np.maximum(hi - lo + 1, 0).sum())


def _dense_flops_per_layer(config, tokens: int) -> tuple[float, float]:
    """Forward FLOPs of one layer's q/k/v projections and of the rest of its matmuls."""
    m = config.model
    qkv = 2 * tokens * m.d_model * m.head_dim * (m.num_heads + 2 * m.num_kv_heads)
    rest = 2 * tokens * (m.d_model * m.head_dim * m.num_heads + 3 * m.d_model * m.mlp_dim)
    return qkv, rest


def recomputed_flops_per_step(config) -> float:
    """Forward FLOPs run a second time in the backward, per step (not counted by MFU).

    Under attention.residuals=save_qkv, remat_policy "nothing_saveable" recomputes each block's
    q/k/v projections and its output projection + MLP; the "*_saveable" policies keep the
    matmul outputs and recompute only elementwise work, counted as none. recompute_qkv puts the
    layer under one VJP that recomputes all of them whatever the remat policy; offload_qkv the
    same but q, k, v, which come back from the host. The attention ring is never recomputed."""
    m, d = config.model, config.data
    qkv, rest = _dense_flops_per_layer(config, d.global_batch_size * d.seq_len)
    residuals = config.attention.get("residuals", "save_qkv")
    if residuals == "recompute_qkv":
        per_layer = qkv + rest
    elif residuals == "offload_qkv":
        per_layer = rest
    else:
        per_layer = qkv + rest if m.remat_policy == "nothing_saveable" else 0
    return float(m.num_layers * per_layer)


def matmul_params_per_layer(config) -> int:
    """Weights one decoder layer multiplies by every token: the attention projections and the MLP."""
    m = config.model
    return m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * m.d_model * m.mlp_dim


def dense_flops_per_step(config) -> float:
    """Training FLOPs of one step's matmuls with weights (projections, MLP, output projection)."""
    m, d = config.model, config.data
    tokens = d.global_batch_size * d.seq_len
    return 3.0 * 2 * tokens * (m.num_layers * matmul_params_per_layer(config) + m.d_model * m.vocab_size)


def attention_flops_per_step(config) -> float:
    """Training FLOPs of one step's attention (QK^T and PV) over the pairs the static mask keeps,
    each layer by its own type's mask (hybrid attention: longctx/model/layer_types.py)."""
    m, d = config.model, config.data
    types = layer_types.period(config)
    pairs = 0
    for layer_type, count in zip(types, layer_types.layer_counts(m.num_layers, len(types))):
        a = layer_type.attention
        pairs += count * kept_pairs(d.seq_len, causal=a.causal, sliding_window=a.sliding_window,
                                    chunk_size=a.chunk_size)
    # 2 matmuls x 2 FLOPs per multiply-add, per head, per kept pair.
    return 3.0 * 4 * d.global_batch_size * m.num_heads * m.head_dim * pairs


def flops_per_step(config) -> float:
    """Training FLOPs of one step (forward + backward = 3x forward), for the global batch."""
    return dense_flops_per_step(config) + attention_flops_per_step(config)
