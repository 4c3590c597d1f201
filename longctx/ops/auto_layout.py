"""attention.layout='auto': the layout whose ring finishes first for a mask, and for the rows of
packed documents when they are given. Scored on the ring's own block tables (tables.py), so it
lives above them; masks.py (which the tables are built from) stays below.
"""

from __future__ import annotations

from longctx.ops import tables
from longctx.ops.masks import default_block_size, make_mask_spec
from longctx.parallel import layout as layout_lib


def resolve_layout(layout: str, seq_len: int, num_shards: int, *, causal=False,
                   sliding_window=None, chunk_size=None, block_size: int | None = None,
                   segment_ids=None) -> str:
    """Concrete layout name; "auto" picks the layout whose ring finishes first for the mask, and
    with `segment_ids` for the mask on those rows of packed documents.

    "Finishes first" = the smallest critical path, sum over run steps of max over devices of
    computed blocks (the denominator of the efficiency), plus one block per run step, counted in
    (query, key) pairs. For a fixed mask the useful work is the same in every layout up to block
    rounding, so this is the highest efficiency measured in useful work; it also stops a
    perfectly balanced but wasteful layout from winning. The block per step is what a step costs
    beyond its blocks (its K/V's first block arrives before any compute hides the transfer, and
    its output is merged): it decides between layouts whose paths are level, such as striped and
    contiguous under a 4,096-token window at 128K tokens on 8 devices (287 and 288 blocks, on 8
    ring steps against 2). Ties: higher efficiency, fewer steps, then the order of
    `layout.LAYOUTS`.

    Each layout is scored with `block_size`, the block the ring will run, when the caller knows
    it (train.resolve_layout: attention.block_size; the pipeline and the model are both given the
    result), else with its `default_block_size`: what ring_attention(layout="auto") does, so that
    a data pipeline resolving "auto" without knowing the block agrees with it.

    `segment_ids` (natural-order [rows, S], 0 = padding; e.g. data.pipeline.layout_sample's):
    each layout is scored on what its ring computes on those rows (tables.document_schedule):
    the critical path over the steps that run plus one block per step the ring goes through, and
    fewer blocks in all on ties. Documents change the answer: the static choice balances the
    causal triangle, but packed documents keep only bands along the diagonal, which a layout that
    stripes the row balances better (on 8 rows of the embedded corpus at 131,072 tokens, sp=8,
    block 512, causal: critical path 29,552 blocks contiguous, 21,807 zigzag, 15,784 striped).
    With documents the per-document layout (parallel/document_layout.py) is scored too, each row
    laid out from its own documents as the data pipeline will.
    """
    mask = dict(causal=causal, sliding_window=sliding_window, chunk_size=chunk_size)
    return resolve_layout_for_layers(layout, seq_len, num_shards, [(1, mask, block_size)], segment_ids)


def resolve_layout_for_layers(layout: str, seq_len: int, num_shards: int, layers,
                              segment_ids=None) -> str:
    """`resolve_layout` for a model whose layers differ in mask (hybrid attention: the layout is one
    for the whole step). `layers`: (layer count, mask keywords, block size or None) per layer
    type; each layout's score is `resolve_layout`'s, summed over the types weighted by their layer
    counts, so a Gemma-3-like 5:1 model weighs its window layers five times its global one. With
    one type it is `resolve_layout` itself."""
    if layout_lib.per_row(layout):
        if seq_len % num_shards:
            raise ValueError(f"seq_len={seq_len} is not divisible by num_shards={num_shards}")
        return layout
    if layout != "auto":
        layout_lib.permutation(layout, seq_len, num_shards)
        return layout
    best, best_key = None, None
    # With documents the per-document layout competes: each row laid out from its own documents.
    names = layout_lib.LAYOUTS + (layout_lib.ROW_LAYOUTS if segment_ids is not None else ())
    for rank, name in enumerate(names):
        try:
            if not layout_lib.per_row(name):
                layout_lib.permutation(name, seq_len, num_shards)
        except ValueError:
            continue  # e.g. zigzag needs seq_len divisible by 2*sp
        scores = [[count * part for part in _score(name, seq_len, num_shards, block, mask, segment_ids)]
                  for count, mask, block in layers]
        key = (*map(sum, zip(*scores)), rank)
        if best_key is None or key < best_key:
            best, best_key = name, key
    if best is None:
        raise ValueError(f"seq_len={seq_len} is not divisible by num_shards={num_shards}")
    return best


def _score(name: str, seq_len: int, num_shards: int, block: int | None, mask: dict, segment_ids):
    """(path cost in (query, key) pairs, tie-break, ring steps) of one layout for one mask: smaller
    is better (`resolve_layout`'s docstring says what each is)."""
    block = block or default_block_size(seq_len // num_shards, name)
    # In (query, key) pairs: the layouts' default blocks can differ (zigzag's is smaller).
    if segment_ids is None:
        sched = tables.ring_schedule(seq_len, num_shards, block, name, mask["causal"],
                                     mask["sliding_window"], mask["chunk_size"])
        return ((sched.critical_path + sched.steps) * block * block, -round(sched.efficiency, 9),
                sched.steps)
    spec = make_mask_spec(mask["causal"], mask["sliding_window"], mask["chunk_size"])
    docs = tables.document_schedule(spec, name, seq_len, num_shards, block, segment_ids,
                                    count_kept=False)
    steps = len(docs.visited_steps)
    return ((docs.critical_path + steps) * block * block, int(docs.computed_blocks.sum()) * block * block,
            steps)
