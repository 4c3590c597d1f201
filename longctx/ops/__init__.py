"""Attention over the sp axis: the ring, the other context-parallel strategies, their backends.

Public API:
  ring_attention(query, key, value, q_segment_ids=None, kv_segment_ids=None, softmax_aux=None,
                 *, positions=None, causal=False, sliding_window=None, chunk_size=None,
                 logits_soft_cap=None, softmax_scale=None, axis_name="sp", layout="contiguous",
                 impl="splash", block_sizes=None) -> [batch, L, heads, head_dim]
      Call inside jax.shard_map with `axis_name` bound, on this device's shard in layout order.
      layout="per_document": each row laid out from its documents by the data pipeline
      (longctx.parallel.document_layout); segment ids and positions required.
  context_parallel_attention(..., strategy="ring", ulysses_degree=None, **ring_attention's)
      The same, by strategy "ring" | "all_gather" | "ulysses" | "usp" | "halo" (STRATEGIES).
  reference_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, softmax_aux=None, *,
                      positions, causal, sliding_window, chunk_size, logits_soft_cap, softmax_scale)
      Dense oracle on whole natural-order sequences (tests).
  resolve_layout(layout, seq_len, num_shards, *, causal=False, sliding_window=None,
                 chunk_size=None, block_size=None) -> str
      The concrete layout ring_attention uses for `layout` ("auto" -> the layout whose ring
      finishes first for the mask; with `segment_ids`, on those rows, the per-document layout
      among the candidates). The data pipeline permutes every row with
      `longctx.parallel.layout.permutation(resolve_layout(...), seq_len, sp)` (or each row with
      its own, `longctx.parallel.document_layout.permute_rows`) so that tokens arrive in the
      order the attention expects; call it with the same mask keywords as the model.
      block_size scores the layouts with the ring's block; then give the model the concrete
      layout (ring_attention's own "auto" scores with default blocks, as block_size=None does).
  resolve_layout_for_layers(layout, seq_len, num_shards, layers, segment_ids=None) -> str
      The same for layers of several masks (hybrid attention): `layers` holds (layer count,
      mask keywords, block size) per layer type, each layout scored over all of them.
  ring_schedule_efficiency(seq_len, num_shards, block_size=None, layout="contiguous",
                           causal=False, sliding_window=None, chunk_size=None) -> float
      useful blocks / (sp * sum over run steps of max over devices of computed blocks), for a
      concrete layout (benchmarks, configs). `ring_schedule(...)` returns the full Schedule:
      computed_blocks [device, step], run_steps, efficiency, steps, critical_path.
"""
from longctx.ops.auto_layout import resolve_layout, resolve_layout_for_layers
from longctx.ops.context_parallel import STRATEGIES, context_parallel_attention
from longctx.ops.reference import reference_attention
from longctx.ops.ring import IMPLS, ring_attention
from longctx.ops.tables import ring_schedule, ring_schedule_efficiency

__all__ = ["IMPLS", "STRATEGIES", "context_parallel_attention", "ring_attention", "reference_attention", "resolve_layout", "resolve_layout_for_layers", "ring_schedule",
           "ring_schedule_efficiency"]
