"""Model FLOPs per step and the chips' peak, for MFU.

Attention FLOPs count only the (query, key) pairs the mask keeps: MaxText's convention (causal
attention counts half the square) made exact, the diagonal included, windows and chunks their
band. With packed documents (attention.use_segment_ids) they count the pairs inside each
document, as the ring computes them (positions, windows and chunks restart at each document; a
padding token, segment id <= 0, attends to nothing): per batch, from the segment ids actually in
it (`attention_pairs`, which the training loop runs on the host's copy of each batch). A run
must not look better than it is by being credited for pairs it never computes: a row of many
short documents does a small share of the row's causal attention. Without segment ids (or
without a batch) each row is one document. `attention_convention` says in words what is counted.

MFU counts model FLOPs only (`flops_per_step`: forward + backward of the model, 3x forward).
Work done twice is never credited: rematerialisation (`model.remat_policy`) and what
`attention.residuals=recompute_qkv` or `offload_qkv` runs again in the backward cost step time
but add nothing to the count, so a policy that recomputes shows its cost as a lower MFU.
`recomputed_flops_per_step` says how much extra work each setting does (hardware FLOPs =
model FLOPs + that).
"""

from __future__ import annotations

import numpy as np

from longctx.model import layer_types, remat

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
    """Number of (i, j) pairs the mask keeps in one sequence of `seq_len` tokens.

    The masks are those of `longctx.model.attention.mask_kwargs`: `sliding_window=w` is one-sided (token i sees
    [i - w, i]) with or without `causal`, and `chunk_size` is chunked causal attention."""
    return pairs_in_documents([seq_len], causal=causal, sliding_window=sliding_window, chunk_size=chunk_size)


def pairs_in_documents(lengths, *, causal: bool, sliding_window: int | None, chunk_size: int | None) -> int:
    """Pairs the mask keeps in documents of `lengths` tokens, each attending only to itself, in
    closed form (O(documents)).

    Query i of a document keeps keys [lo_i, i] under a causal mask or a window, where lo_i is
    max(0, i - w, the start of i's chunk): i - lo_i = min(r_i, w), with r_i = i mod chunk (i
    without chunks). So a run of m queries counted from a chunk's (or the document's) start keeps
    g(m) = sum_{r < m} (min(r, w) + 1) pairs, and a document of n = q * chunk + rem tokens
    q * g(chunk) + g(rem). Without causal, window or chunk every query sees the whole document."""
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not causal and sliding_window is None and chunk_size is None:
        return int(np.sum(n * n))

    def run(m):  # g(m): the pairs of m queries from a chunk's start
        if sliding_window is None:
            return m * (m + 1) // 2
        w = int(sliding_window)
        return np.where(m <= w + 1, m * (m + 1) // 2, (w + 1) * (w + 2) // 2 + (m - w - 1) * (w + 1))

    if chunk_size is None:
        return int(np.sum(run(n)))
    c = int(chunk_size)
    return int(np.sum((n // c) * run(np.int64(c)) + run(n % c)))


def document_lengths(segment_ids) -> np.ndarray:
    """The lengths of every document in rows of segment ids [rows, seq_len] (any token order: a
    document's tokens share its id in its row), padding (id <= 0) left out."""
    ids = np.asarray(segment_ids, dtype=np.int64)
    ids = ids.reshape(-1, ids.shape[-1])
    valid = ids > 0
    if not valid.any():
        return np.zeros(0, np.int64)
    span = int(ids.max()) + 1  # each row's ids counted apart: offset by the row
    offset = np.arange(ids.shape[0], dtype=np.int64)[:, None] * span
    counts = np.bincount((ids + offset)[valid])
    return counts[counts > 0]


def attention_pairs(config, segment_ids=None) -> int:
    """(Query, key) pairs the step's attention keeps, summed over its layers (each layer by its
    type's mask: hybrid attention, longctx/model/layer_types.py) and its rows.

    `segment_ids` [rows, seq_len]: the batch's rows (any token order, the sp layout's included);
    with attention.use_segment_ids each attends inside its documents only. None: the config's
    global batch of rows of one document each."""
    m, d = config.model, config.data
    if segment_ids is None or not config.attention.use_segment_ids:
        rows = d.global_batch_size if segment_ids is None else int(np.asarray(segment_ids).shape[0])
        lengths = np.full(rows, d.seq_len, np.int64)
    else:
        lengths = document_lengths(segment_ids)
    types = layer_types.period(config)
    pairs = 0
    for layer_type, count in zip(types, layer_types.layer_counts(m.num_layers, len(types))):
        a = layer_type.attention
        pairs += count * pairs_in_documents(lengths, causal=a.causal, sliding_window=a.sliding_window,
                                            chunk_size=a.chunk_size)
    return pairs


def attention_convention(config) -> str:
    """What `attention_pairs` counts, in words ("causal pairs within documents")."""
    types = layer_types.period(config)
    masks = {_mask_words(t.attention) for t in types}
    what = masks.pop() if len(masks) == 1 else "each layer type's mask's"
    where = "within documents" if config.attention.use_segment_ids else "of whole rows"
    return f"{what} pairs {where}"


def _mask_words(attention) -> str:
    words = "causal" if attention.causal else "bidirectional"
    if attention.sliding_window is not None:
        words = f"window-{attention.sliding_window}"
    if attention.chunk_size is not None:
        words += f" chunk-{attention.chunk_size}"
    return words


def _dense_flops_per_layer(config, tokens: int) -> tuple[float, float]:
    """Forward FLOPs of one layer's q/k/v projections and of the rest of its matmuls."""
    m = config.model
    qkv = 2 * tokens * m.d_model * m.head_dim * (m.num_heads + 2 * m.num_kv_heads)
    rest = 2 * tokens * (m.d_model * m.head_dim * m.num_heads + 3 * m.d_model * m.mlp_dim)
    return qkv, rest


def recomputed_flops_per_step(config) -> float:
    """Forward FLOPs run a second time in the backward, per step (not counted by MFU).

    Under attention.residuals=save_qkv, the block's matmuls whose outputs the remat policy does not
    keep (model/remat.py `kept_matmuls`): all of them under "nothing_saveable" (each block's q/k/v
    projections, its output projection and MLP), none under "none" and the dots policies, the
    others under a named policy; elementwise work counts as none. recompute_qkv puts the layer
    under one VJP that recomputes all of them whatever the remat policy; offload_qkv the same but
    q, k, v, which come back from the host. The attention ring is never recomputed."""
    m, d = config.model, config.data
    tokens = d.global_batch_size * d.seq_len
    qkv, rest = _dense_flops_per_layer(config, tokens)
    residuals = config.attention.get("residuals", "save_qkv")
    if residuals == "recompute_qkv":
        per_layer = qkv + rest
    elif residuals == "offload_qkv":
        per_layer = rest
    else:
        weights = remat.matmul_weights(m)
        per_layer = qkv + rest - sum(2 * tokens * weights[name] for name in remat.kept_matmuls(m))
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


def attention_flops_per_step(config, pairs: int | None = None) -> float:
    """Training FLOPs of one step's attention (QK^T and PV) over `pairs` (attention_pairs: the
    batch's, summed over layers); None: the config's global batch of rows of one document."""
    m = config.model
    pairs = attention_pairs(config) if pairs is None else pairs
    # 2 matmuls x 2 FLOPs per multiply-add, per head, per kept pair.
    return 3.0 * 4 * m.num_heads * m.head_dim * pairs


def flops_per_step(config, pairs: int | None = None) -> float:
    """Training FLOPs of one step (forward + backward = 3x forward), for the global batch, its
    attention over `pairs` (attention_flops_per_step)."""
    return dense_flops_per_step(config) + attention_flops_per_step(config, pairs)
