"""The per-document layout (parallel/document_layout.py) and the data path that applies it: each
row's own permutation keeps every token with its target, position and loss mask; the renumbered
segment ids give every document a run of global positions of its own; the same row is laid out
the same on every call and after a resume; and on long-tailed documents the ring's critical path
is within a few percent of the ideal where the static layouts are not."""
import json

import numpy as np
import pytest

from longctx.data import make_batch_iterator
from longctx.data import length_mixes
from longctx.ops import masks, tables
from longctx.parallel import document_layout
from tests.data.test_data_pipeline import mesh_of, take, tiny_config


def _rows(seed, count, seq_len, lengths=(5, 40, 300, 900, 3000)):
    """Natural-order segment ids [count, seq_len] of documents of the given lengths, at random,
    with padding at the end of every other row."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(count):
        n = [int(rng.choice(lengths)) for _ in range(seq_len)]
        ids = np.repeat(np.arange(1, len(n) + 1), n)[:seq_len].astype(np.int32)
        if r % 2:
            ids[-int(rng.integers(1, seq_len // 8)):] = 0
        out.append(ids)
    return np.stack(out)


def _packed(lengths, seq_len):
    """One natural-order row of segment ids [seq_len]: documents 1, 2, ... of `lengths` in
    order, padding after them."""
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)
    return np.r_[ids, np.zeros(seq_len - len(ids), np.int32)]


def _causal_schedule(ids, sp, block):
    """The ring's schedule of one row in the per-document layout, causal, needed blocks counted."""
    spec = masks.make_mask_spec(causal=True)
    return tables.document_schedule(spec, "per_document", len(ids), sp, block, ids[None])


@pytest.mark.parametrize("seq_len,sp,block", [(4096, 4, 128), (8192, 8, 128), (2048, 2, 256)])
def test_a_row_laid_out_keeps_its_documents(seq_len, sp, block):
    for seed, ids in enumerate(_rows(0, 6, seq_len)):
        layout = document_layout.row_layout(ids, sp, block)
        perm = layout.permutation
        assert np.array_equal(np.sort(perm), np.arange(seq_len))
        assert np.array_equal(ids[perm] > 0, layout.segment_ids > 0)  # padding stays padding
        # one new id per document, and its tokens are that document's
        for new in np.unique(layout.segment_ids[layout.segment_ids > 0]):
            assert len(np.unique(ids[perm][layout.segment_ids == new])) == 1
        # global positions: every document one run, disjoint from the others'
        positions = masks.segment_positions(ids)[perm]
        where = document_layout.global_positions(layout.segment_ids, positions)
        real = layout.segment_ids > 0
        assert len(np.unique(where[real])) == real.sum()
        for new in np.unique(layout.segment_ids[real]):
            run = np.sort(where[layout.segment_ids == new])
            assert np.array_equal(run, np.arange(new - 1, new - 1 + len(run)))
        again = document_layout.row_layout(ids.copy(), sp, block)
        assert np.array_equal(again.permutation, perm)
        assert np.array_equal(again.segment_ids, layout.segment_ids)


def test_positions_beyond_a_documents_length_get_room():
    """A caller's rows (inference) may start a document at any position: the numbering leaves
    room for them, so no two documents' global positions meet."""
    ids = np.repeat(np.arange(1, 5), [100, 200, 50, 162]).astype(np.int32)
    positions = masks.segment_positions(ids) + np.repeat([0, 1000, 7, 0], [100, 200, 50, 162])
    layout = document_layout.row_layout(ids, 2, 128, positions)
    where = document_layout.global_positions(layout.segment_ids, positions[layout.permutation])
    assert len(np.unique(where)) == len(ids)


def _iterator(data_dir, layout):
    c = tiny_config()
    c.attention.block_size = 16  # shards of 16 tokens: SEQ 64 over sp 4
    return make_batch_iterator(c, mesh_of(c), split="train", layout=layout, data_dir=data_dir)


def test_the_pipeline_lays_each_row_out_with_its_tokens(data_dir):
    natural = take(_iterator(data_dir, "contiguous"), 3)
    laid = take(_iterator(data_dir, "per_document"), 3)
    for nat, got in zip(natural, laid):
        for r in range(len(nat["tokens"])):
            row = document_layout.row_layout(nat["segment_ids"][r], 4, 16)
            for key in ("tokens", "targets", "positions", "loss_mask"):
                assert np.array_equal(got[key][r], nat[key][r][row.permutation]), key
            assert np.array_equal(got["segment_ids"][r], row.segment_ids)


def test_a_restored_iterator_lays_out_the_same_rows(data_dir):
    it = _iterator(data_dir, "per_document")
    take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 3)
    fresh = _iterator(data_dir, "per_document")
    fresh.set_state(state)
    got = take(fresh, 3)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(expected, got) for k in a)


def test_long_tailed_documents_keep_the_ring_balanced():
    """Rows of the long-tail mix at 65,536 tokens, sp 8, block 512: the per-document layout's
    critical path is within 5% of the ideal (kept blocks / sp of the natural order), where the
    best static layout is not."""
    from longctx.data import packer_report  # (grain packing: what ring_report --mix runs)

    seq_len, sp, block = 65_536, 8, 512
    lengths = length_mixes.document_lengths("long_tail", 8 * seq_len, seed=1)
    rows = packer_report.document_rows(length_mixes.documents(lengths), "best_fit", seq_len=seq_len,
                                       sp=sp, block=block, keep=None).segment_ids
    spec = masks.make_mask_spec(causal=True)
    contiguous = packer_report.row_schedules(spec, "contiguous", seq_len, sp, block, rows)
    kept = packer_report.kept_blocks(spec, seq_len, sp, block, rows, contiguous)
    of_ideal = {layout: packer_report.summarize(
        packer_report.row_schedules(spec, layout, seq_len, sp, block, rows), kept, sp, seq_len)["of_ideal"]
        for layout in ("per_document", "striped")}
    assert of_ideal["per_document"] >= 0.95, of_ideal
    assert of_ideal["per_document"] > of_ideal["striped"], of_ideal
    # the host schedule counts what the ring computes, every block of it needed
    one = tables.document_schedule(spec, "per_document", seq_len, sp, block, rows[:1])
    assert one.kept_blocks == one.computed_blocks.sum()


def test_the_ring_computes_no_block_for_nothing():
    """Two long documents spread, their last partial blocks on shards that hold whole documents
    too: each shard's pieces are ordered and numbered so that no block's range of ids covers a
    document that lives elsewhere, and every block the ring computes holds a needed pair."""
    seq_len, sp, block = 8192, 4, 128
    schedule = _causal_schedule(_packed([3637, 1969, 316, 240, 217, 1813], seq_len), sp, block)
    assert schedule.kept_blocks == schedule.computed_blocks.sum()


def test_documents_inside_a_block_are_numbered_as_one_run():
    """Spread documents' last partial blocks and a scattered document's pieces share a shard
    with no whole document to fill between them, so pieces of one document reach several blocks:
    the documents strictly inside each block are numbered one after the other and the pieces
    ordered so that few blocks hold a cut one, and the ring computes only needed blocks."""
    seq_len, sp, block = 16384, 8, 128
    lengths = [4675, 87, 144, 1162, 2706, 1946, 3846, 1778]
    ids = _packed(lengths, seq_len)
    schedule = _causal_schedule(ids, sp, block)
    assert schedule.kept_blocks == schedule.computed_blocks.sum()


def test_padding_fills_between_shared_pieces():
    """A row with padding (1,460 tokens) whose shards hold the last partial blocks of spread
    documents: a shard lays its padding between pieces where it keeps a shared piece from being
    cut across a block edge (padding is no document to the ring's block tests), so it is not
    all at the shard's end, and the ring computes only needed blocks (14 more with the padding
    at the ends)."""
    seq_len, sp, block = 16384, 8, 128
    lengths = [1714, 1846, 939, 2594, 619, 2218, 339, 1837, 813, 919, 1086]
    ids = _packed(lengths, seq_len)
    schedule = _causal_schedule(ids, sp, block)
    assert schedule.kept_blocks == schedule.computed_blocks.sum()
    shards = document_layout.row_layout(ids, sp, block).segment_ids.reshape(sp, -1)
    assert any(((shard[:-1] == 0) & (shard[1:] > 0)).any() for shard in shards)


def test_whole_documents_fill_the_gaps_of_partial_blocks_first():
    """A full row (57 tokens of padding): spread documents' last partial blocks leave gaps to
    their blocks' ends, and a whole document that fits a shard's gaps goes there, so that the
    shard need not cut a shared piece to fill them: the ring computes only needed blocks (8 more,
    and a critical path of 181 blocks against 169, with the least step-0 work deciding alone)."""
    seq_len, sp, block = 16384, 8, 128
    lengths = [90, 3598, 1184, 1148, 2161, 116, 648, 3419, 186, 282, 1585, 1032, 233, 645]
    ids = _packed(lengths, seq_len)
    schedule = _causal_schedule(ids, sp, block)
    assert schedule.kept_blocks == schedule.computed_blocks.sum()
    assert schedule.computed_blocks.max(axis=0).sum() <= 169
