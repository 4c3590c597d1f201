"""Where a ring step's blocks come from: one object per kind of layout, which the ring and every
strategy ask instead of testing the layout's name.

  ClosedFormBlocks  every static layout (contiguous, zigzag, striped, ...): a shard's positions
                    are known in closed form, so a step's blocks are too (tables.step_blocks),
                    the same for every row; documents, when they prune, remove the blocks whose
                    queries and keys share no document, from the blocks' id ranges.
  RowBlocks         a per-row layout (the per-document one): each token's global position is
                    data, [b, L] per shard, travelling with K/V beside the segment ids (a
                    tables.RowTokens), and a step's blocks are classed per row from summaries
                    of the tokens (row_blocks.py), documents included.

Each answers the same four questions: what the queries' side is summarised by (`query_side`),
the blocks and live blocks of a (query shard, K/V shard) pair (`pair`), whether the live blocks
depend on the data (`data_dependent`), and at which run steps any device of the ring has a live
block (`live_steps`, for the ring's early stop).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from longctx.ops import row_blocks
from longctx.ops import tables as tables_lib
from longctx.ops.shmap import pick
from longctx.parallel import layout as layout_lib


class ClosedFormBlocks:
    def __init__(self, cfg):
        self.cfg = cfg

    def query_side(self, qs):
        """The queries' blocks' document ranges (None without documents)."""
        return None if qs is None else tables_lib.document_ranges(qs, self.cfg.bq)

    def data_dependent(self, qs) -> bool:
        """Whether the live blocks depend on the data: documents that prune."""
        return qs is not None and self.cfg.skip_documents

    def pair(self, q_shard, kv_shard, q_side, qs, ks):
        """(blocks, live) of query shard `q_shard` (with `query_side`'s summary) against K/V
        shard `kv_shard` (traced ints) with ids `ks`."""
        blocks = self._blocks(q_shard, kv_shard)
        return blocks, self._live(blocks, q_side, ks)

    def _blocks(self, q_shard, kv_shard):
        cfg = self.cfg
        return tables_lib.step_blocks(cfg.spec, cfg.layout, cfg.seq_len, cfg.sp, cfg.bq, cfg.bkv,
                                      q_shard, kv_shard)

    def _live(self, blocks, q_ranges, ks):
        """The static mask's blocks, less those whose queries and keys share no document."""
        if not self.cfg.skip_documents:
            q_ranges = None
        kv_ranges = None if q_ranges is None else tables_lib.document_ranges(ks, self.cfg.bkv)
        return tables_lib.live_blocks(blocks.classes, q_ranges, kv_ranges)

    def live_steps(self, d, q_side, ks):
        """bool [run steps]: whether device d has a live block at each run step. Each device
        reads every shard's K/V document ranges (a few ints per block, all-gathered)."""
        cfg = self.cfg
        kv_first, kv_last = (lax.all_gather(x, cfg.axis_name)
                             for x in tables_lib.document_ranges(ks, cfg.bkv))

        def any_live(t):
            source = pick(cfg.tables.kv_source, d, t)
            blocks = self._blocks(d, source)
            return jnp.any(tables_lib.live_blocks(blocks.classes, q_side,
                                                  (kv_first[source], kv_last[source])))

        return jax.vmap(any_live)(jnp.arange(len(cfg.tables.run_steps), dtype=jnp.int32))


class RowBlocks:
    def __init__(self, cfg):
        self.cfg = cfg

    def query_side(self, qs):
        """The queries' blocks' summaries (row_blocks.Parts of the ids and global positions in
        `qs`, a tables.RowTokens; None without)."""
        return None if qs is None else row_blocks.parts(qs.ids, qs.positions, self.cfg.bq)

    def data_dependent(self, qs) -> bool:
        return qs is not None

    def pair(self, q_shard, kv_shard, q_side, qs, ks):
        """(blocks, live): the blocks' own classes, documents included; the shard indices
        play no part, the tokens say where they are."""
        cfg = self.cfg
        blocks = tables_lib.row_step_blocks(cfg.spec, q_side, qs, ks, cfg.bkv, cfg.skip_documents)
        return blocks, blocks.classes > 0

    def live_steps(self, d, q_side, ks):
        """As ClosedFormBlocks.live_steps, from every shard's K/V block summaries."""
        cfg = self.cfg
        every = jax.tree.map(lambda x: lax.all_gather(x, cfg.axis_name),
                             row_blocks.parts(ks.ids, ks.positions, cfg.bkv))

        def any_live(t):
            visiting = jax.tree.map(lambda x: x[pick(cfg.tables.kv_source, d, t)], every)
            return jnp.any(row_blocks.classes(cfg.spec, q_side, visiting, cfg.skip_documents) > 0)

        return jax.vmap(any_live)(jnp.arange(len(cfg.tables.run_steps), dtype=jnp.int32))


def of(cfg) -> ClosedFormBlocks | RowBlocks:
    """The block source of a ring configuration (ring.RingConfig)."""
    return RowBlocks(cfg) if layout_lib.per_row(cfg.layout) else ClosedFormBlocks(cfg)
