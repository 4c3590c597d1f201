"""longctx.evals.inference with packed documents and chunked attention, and the host's count of chunks.

The ring counts chunked attention's chunks from each document's start: it names a chunk by the
column where it starts, column - (in-document position mod chunk_size), so the positions decide
the chunks. Rows given with segment ids and no positions get in-document positions (as packed
training rows have them); positions that would start a chunk before its document (so that two
documents could share a chunk, or a chunk id fall to padding's <= 0) are refused in one sentence.
The host's tables (`tables.document_schedule`, and through it `layout="auto"` on documents) count
the same chunks per document: checked against the definition, pair by pair.
"""

import dataclasses

import jax
import numpy as np
import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.evals import inference
from longctx.model import flops
from longctx.ops import auto_layout, masks, tables

CHUNK = 24
SMALL = {"mesh.dp": 1, "mesh.fsdp": 2, "mesh.sp": 4, "model.vocab_size": 64, "model.d_model": 64,
         "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
         "model.mlp_dim": 128, "model.dtype": "float32", "model.remat_policy": "none",
         "attention.impl": "xla", "attention.layout": "zigzag", "attention.block_size": 16,
         "attention.chunk_size": CHUNK, "data.seq_len": 128, "data.global_batch_size": 2,
         "train.loss_chunk_size": 32}


@pytest.fixture(scope="module")
def runner():
    config = base.get_config("tiny")
    config_lib.apply_overrides(config, SMALL)
    r = inference.make_runner(config, lambda *_: None)
    with jax.set_mesh(r.mesh):
        params = r.setup.init(jax.random.PRNGKey(0)).params
    return dataclasses.replace(r, params=params)


def test_segment_ids_without_positions_count_chunks_from_each_document(runner):
    """Document B packed after a 20-token document A, given segment ids only, gets the logits it
    gets alone in its row: its positions, and so its chunks, start at its first token. With row
    positions B's first chunk would be A's (chunk ids 1 + 0 for columns 0-23) and its chunks
    would start at columns 24, 48, ... instead of at B's positions 24, 48, ..."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 20), rng.integers(0, 64, 60)
    two = lambda x: np.repeat(x[None], 2, axis=0)  # noqa: E731  (a whole batch: dp x fsdp = 2)
    packed = {"tokens": two(np.concatenate([a, b])), "segment_ids": two(np.repeat([1, 2], [20, 60]))}
    alone = {"tokens": two(b), "segment_ids": np.full((2, 60), 7)}
    got = runner.logits_at(packed, two(np.arange(20, 80)))
    want = runner.logits_at(alone, two(np.arange(60)))
    assert np.abs(want).max() > 0.1  # logits large enough for a wrong chunk to show
    # The same sums in another place of the ring: float32 rounding, far below any change of mask.
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_one_row_on_two_data_shards_is_padded_and_dropped(runner):
    tokens = np.random.default_rng(1).integers(0, 64, (2, 60))  # (the shapes of the test above: one compile)
    both = runner.logits_at({"tokens": tokens}, np.tile(np.arange(60), (2, 1)))
    one = runner.logits_at({"tokens": tokens[1:]}, np.arange(60)[None])
    assert one.shape == (1, 60, 64)
    # The same row through the same program, on the other fsdp shard's devices.
    np.testing.assert_allclose(one[0], both[1], rtol=1e-6, atol=1e-6 * np.abs(both).max())


@pytest.mark.parametrize("positions, where", [
    (np.arange(80)[None], "row 0, column 20 is at position 20, 0 tokens into its document"),
    (np.concatenate([np.arange(20), np.arange(100, 160)])[None], "row 0, column 20 is at position 100, 0 tokens into its document"),
])
def test_positions_that_start_a_chunk_before_its_document_are_refused(runner, positions, where):
    rows = {"tokens": np.ones((1, 80), np.int32), "positions": positions,
            "segment_ids": np.repeat([[1, 2]], [20, 60], axis=1)}
    with pytest.raises(ConfigError, match=f"positions: {where}, so with attention.chunk_size={CHUNK} "
                       "its chunk would start before the document does"):
        runner.logits_at(rows, np.zeros((1, 1), np.int32))


def test_positions_continuing_a_document_at_a_chunk_boundary_are_accepted(runner):
    rows = {"tokens": np.ones((1, 60), np.int32), "positions": 2 * CHUNK + np.arange(60)[None]}
    assert runner.logits_at(rows, np.arange(60)[None]).shape == (1, 60, 64)


# ----------------------------------------------------------------------------- the host's count


def _documents(lengths_by_row, seq_len):
    return np.stack([np.repeat(np.arange(1, len(lengths) + 1), lengths)[:seq_len]
                     for lengths in lengths_by_row]).astype(np.int32)


def _needed_blocks(seg, chunk, layout, seq_len, sp, block):
    """Blocks (row, device, ring step, q block, kv block) holding a pair that causal chunked
    attention per document keeps: same document, key not after query, same chunk of the
    document (in-document position // chunk), by brute force."""
    from longctx.parallel import layout as layout_lib

    pos = layout_lib.shard_positions(layout, seq_len, sp)
    col = np.arange(seq_len)
    starts = np.concatenate([[0], np.nonzero(np.diff(seg[0]))[0] + 1])
    needed = 0
    for row in seg:
        starts = np.concatenate([[0], np.nonzero(np.diff(row))[0] + 1])
        in_doc = col - starts[np.searchsorted(starts, col, side="right") - 1]
        keep = ((row[:, None] == row[None, :]) & (col[:, None] >= col[None, :])
                & (in_doc[:, None] // chunk == in_doc[None, :] // chunk))
        for d in range(sp):
            for s in range(sp):
                q, k = pos[d], pos[(d - s) % sp]
                sub = keep[np.ix_(q, k)].reshape(len(q) // block, block, len(k) // block, block)
                needed += int(sub.any(axis=(1, 3)).sum())
    return needed


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_document_schedule_counts_chunks_per_document(layout):
    seq_len, sp, block, chunk = 128, 4, 4, 12
    seg = _documents([[5, 30, 17, 40, 36], [50, 3, 75]], seq_len)
    spec = masks.make_mask_spec(True, None, chunk)
    sched = tables.document_schedule(spec, layout, seq_len, sp, block, seg)
    assert sched.kept_blocks == _needed_blocks(seg, chunk, layout, seq_len, sp, block)
    assert sched.computed_blocks.sum() >= sched.kept_blocks


def test_auto_layout_on_documents_counts_chunks_per_document():
    """A case where counting the row's chunks (the tables before) chose contiguous: the ring runs
    the chunks' causal window over the documents' chunk ids, and on that striped finishes first."""
    seq_len, sp, block, chunk = 256, 4, 16, 24
    seg = _documents([[105, 20, 71, 60], [102, 65, 48, 40, 1]], seq_len)
    chosen = auto_layout.resolve_layout("auto", seq_len, sp, causal=True, chunk_size=chunk, block_size=block,
                                  segment_ids=seg)
    as_the_ring_runs = auto_layout.resolve_layout("auto", seq_len, sp, causal=True, sliding_window=(chunk - 1, 0),
                                            block_size=block, segment_ids=masks.document_chunk_ids(seg, chunk))
    assert chosen == as_the_ring_runs == "striped"


def test_one_document_rows_already_count_chunks_per_document():
    """What run_info's schedule and MFU count, rows of one document, is unchanged by counting chunks
    per document (the document starts at the row's start): the ring's schedule on such a row is the
    static chunk mask's, and its kept pairs are flops.kept_pairs'."""
    seq_len, sp, block, chunk = 128, 4, 8, 20
    one = np.ones((1, seq_len), np.int32)
    for layout in ("contiguous", "zigzag", "striped"):
        static = tables.ring_schedule(seq_len, sp, block, layout, causal=True, chunk_size=chunk)
        docs = tables.document_schedule(masks.make_mask_spec(True, None, chunk), layout, seq_len, sp,
                                        block, one)
        assert docs.kept_blocks == static.computed_blocks.sum() == docs.computed_blocks.sum()
        assert docs.run_steps == static.run_steps
    ids = masks.document_chunk_ids(one, chunk)[0]
    col = np.arange(seq_len)
    pairs = int(((ids[:, None] == ids[None, :]) & (col[:, None] >= col[None, :])).sum())
    assert flops.kept_pairs(seq_len, causal=True, sliding_window=None, chunk_size=chunk) == pairs


def test_run_info_counts_the_steps_the_ring_visits_with_chunks_per_document(tmp_path):
    """Zigzag, 4,096 tokens on sp=8, chunks of 256: the chunks of the row keep one ring step, but
    the ring counts chunks per document, runs the causal window a chunk spans (static steps 0, 1
    and 7, not one run, so it cannot stop early) and sends K/V through all three. run_info says
    so (ring_steps_visited), from the same steps the ring's own tables hold."""
    import json

    from jax.sharding import PartitionSpec as P

    from longctx.ops import ring as ring_lib
    from longctx.parallel import mesh as mesh_lib
    from longctx.train import loop as train

    seq_len, sp, block, chunk = 4096, 8, 128, 256
    mesh = jax.make_mesh((1, 1, sp), ("dp", "fsdp", "sp"), devices=jax.devices()[:sp],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    seen = {}

    def per_shard(q, seg, pos):
        seen["cfg"] = ring_lib.prepare(q, q, q, seg, None, None, positions=pos, causal=True,
                                        chunk_size=chunk, layout="zigzag", impl="xla", block_sizes=block)[0]
        return q

    data = P(("dp", "fsdp"), "sp")
    ids = jax.ShapeDtypeStruct((1, seq_len), np.int32)
    jax.eval_shape(jax.shard_map(per_shard, mesh=mesh, in_specs=(data, data, data), out_specs=data),
                   jax.ShapeDtypeStruct((1, seq_len, 1, 128), np.float32), ids, ids)
    ring_steps = seen["cfg"].tables.run_steps
    assert ring_steps == (0, 1, 7) and not tables.can_stop_early(ring_steps)
    assert tables.ring_schedule(seq_len, sp, block, "zigzag", causal=True, chunk_size=chunk).steps == 1

    config = base.get_config()
    config_lib.apply_overrides(config, {"mesh.dp": 1, "mesh.fsdp": 1, "mesh.sp": sp, "data.seq_len": seq_len,
                                "attention.block_size": block, "attention.chunk_size": chunk,
                                "attention.layout": "zigzag"})
    train._write_run_info(config, str(tmp_path), mesh_lib.make_mesh(config.mesh), "zigzag", "data")
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["ring_steps_run"] == 1 and info["ring_steps_visited"] == len(ring_steps) == 3
