"""Packing invariants, exactly-once coverage of an epoch, data shards, layout permutation."""

import collections
import json

import numpy as np
import pytest

from longctx.data import packing, pipeline, prepare, sharding
from longctx.data.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_PAD
from longctx.parallel import layout as layout_lib

SEQ = 64  # make_corpus's `short`: a fifth of its documents are longer than a row


def rows_of(data_dir, packer, **kw):
    kw.setdefault("seed", 0)
    return list(pipeline.packed_rows(data_dir, "train", seq_len=SEQ, packer=packer, num_epochs=1,
                                     **kw))


def segments(row):
    """(tokens, targets, positions) per segment id > 0 of one row."""
    out = []
    for s in np.unique(row["segment_ids"]):
        if s == 0:
            continue
        idx = np.nonzero(row["segment_ids"] == s)[0]
        out.append((idx, row["tokens"][idx], row["targets"][idx], row["positions"][idx]))
    return out


def doc_ids_in(rows):
    """Ids of the documents whose start (BOS + tag) appears in `rows` (whole-document packers)."""
    ids = []
    for row in rows:
        for _, tok, _, pos in segments(row):
            if pos[0] == 0 and tok[0] == BYTE_BOS and len(tok) >= 6:
                ids.append(int(bytes(tok[2:6].tolist()).decode()))
    return ids


@pytest.mark.parametrize("packer", packing.PACKERS)
def test_packing_invariants(data_dir, packer):
    rows = rows_of(data_dir, packer)
    assert rows
    for row in rows:
        assert set(row) == set(packing.KEYS)
        for v in row.values():
            assert v.shape == (SEQ,) and v.dtype == np.int32
        seg, mask = row["segment_ids"], row["loss_mask"]
        pad = seg == 0
        # Padding: PAD in, PAD out, position 0, no loss.
        assert np.all(row["tokens"][pad] == BYTE_PAD) and np.all(row["targets"][pad] == BYTE_PAD)
        assert np.all(row["positions"][pad] == 0) and np.all(mask == (~pad))
        # Segments are contiguous runs numbered 1, 2, ... in order.
        real_ids = [s for s in seg if s > 0]
        runs = [k for i, k in enumerate(real_ids) if i == 0 or k != real_ids[i - 1]]
        assert runs == list(range(1, len(runs) + 1))
        for idx, tok, tgt, pos in segments(row):
            assert np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))
            assert np.array_equal(pos, np.arange(len(idx)))  # restart at 0 per segment
            # Target at i is the next input within the segment: no leak across a document edge.
            assert np.array_equal(tok[1:], tgt[:-1])
            assert tgt[-1] != BYTE_BOS and BYTE_EOS not in tok
            if BYTE_EOS in tgt:  # a document's end can only be its segment's last target
                assert list(tgt).index(BYTE_EOS) == len(tgt) - 1


@pytest.mark.parametrize("packer", packing.PACKERS)
def test_every_token_is_a_target_exactly_once_per_epoch(data_dir, packer):
    meta = pipeline.load_metadata(data_dir)
    docs = list(pipeline.TokenSource(data_dir, "train", meta))  # the epoch, as stored
    assert any(len(d) > 2 * SEQ for d in docs)  # long documents are in the epoch
    rows = rows_of(data_dir, packer)
    # Every (input, target) pair of every document appears once; nothing else appears.
    want = collections.Counter((int(a), int(b)) for d in docs for a, b in zip(d[:-1], d[1:]))
    got = collections.Counter()
    for row in rows:
        m = row["loss_mask"] == 1
        got.update(zip(row["tokens"][m].tolist(), row["targets"][m].tolist()))
    assert got == want
    assert sum(int(r["loss_mask"].sum()) for r in rows) == sum(len(d) - 1 for d in docs)
    # Document starts: each document begins (BOS as input at position 0) exactly once.
    starts = sum(int(np.sum((r["tokens"] == BYTE_BOS) & (r["positions"] == 0))) for r in rows)
    assert starts == len(docs) == meta["splits"]["train"]["num_documents"]


def test_same_seed_same_rows_different_seed_different_order(data_dir):
    a, b, c = (rows_of(data_dir, "best_fit", seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    assert doc_ids_in(a) != doc_ids_in(c)
    assert sorted(doc_ids_in(a)) == sorted(doc_ids_in(c))


def test_two_data_shards_are_disjoint_and_cover_the_epoch(data_dir):
    all_ids = sorted(doc_ids_in(rows_of(data_dir, "first_fit")))
    parts = [doc_ids_in(rows_of(data_dir, "first_fit", shard_index=i, shard_count=2))
             for i in range(2)]
    assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == all_ids


def test_shard_math_groups_processes_of_one_sp_group():
    import jax
    from jax.sharding import Mesh

    devs = np.array(jax.devices()).reshape(1, 2, 4)  # (dp, fsdp, sp)
    mesh = Mesh(devs, ("dp", "fsdp", "sp"))
    # Four simulated processes with two devices each: processes 0, 1 hold fsdp row-block 0.
    shards = [sharding.data_shard(mesh, 8, 32, process_index=p, process_of=lambda d: d.id // 2)
              for p in range(4)]
    assert [(s.index, s.count, s.row_start, s.row_stop) for s in shards] == [
        (0, 2, 0, 4), (0, 2, 0, 4), (1, 2, 4, 8), (1, 2, 4, 8)]
    # One process holding everything reads everything.
    one = sharding.data_shard(mesh, 8, 32, process_index=0, process_of=lambda d: 0)
    assert (one.index, one.count, one.local_batch_size) == (0, 1, 8)
    with pytest.raises(ValueError, match="global_batch_size=3"):
        sharding.data_shard(mesh, 3, 32)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_layout_permutation_round_trip(data_dir, layout):
    rows = rows_of(data_dir, "best_fit")[:4]
    batch = {k: np.stack([r[k] for r in rows]) for k in packing.KEYS}
    perm = layout_lib.permutation(layout, SEQ, 4)
    laid = packing.PermuteLayout(perm).map(batch)
    inv = layout_lib.inverse_permutation(perm)
    for k in packing.KEYS:
        assert np.array_equal(laid[k][..., inv], batch[k])
    # Each token keeps its position, segment id, target and mask: the tuples are the same set.
    for b in range(len(rows)):
        nat = set(zip(*(batch[k][b].tolist() for k in packing.KEYS)))
        lay = set(zip(*(laid[k][b].tolist() for k in packing.KEYS)))
        assert nat == lay
    assert not np.array_equal(laid["positions"], batch["positions"])


@pytest.fixture
def alarm():
    """Fails the test (TimeoutError) after `seconds` instead of letting a hung loop hang CI."""
    import signal

    def raise_timeout(signum, frame):
        raise TimeoutError("no packed row within the time limit")

    previous = signal.signal(signal.SIGALRM, raise_timeout)
    yield signal.alarm
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("packer", packing.PACKERS)
def test_tiny_split_yields_rows_after_one_epoch_or_two(tmp_path, packer, alarm, monkeypatch):
    """Three documents of 7-18 tokens: the first rows come after at most two epochs of reads
    (plus grain's read-ahead of 64 records), repeating the split, not after filling 1024 bins first
    (~5,000 documents, 37 s, at seq_len 64; ~10 minutes at 1024)."""
    (tmp_path / "tiny.jsonl").write_text("".join(
        json.dumps({"text": t}) + "\n" for t in ("hello", "tiny doc here", "abcdefghijklmnop")))
    prepare.prepare([str(tmp_path / "tiny.jsonl")], str(tmp_path / "data"), val_fraction=0.0,
                    progress=False)
    reads = []
    read = pipeline.TokenSource.__getitem__
    monkeypatch.setattr(pipeline.TokenSource, "__getitem__",
                        lambda self, i: reads.append(i) or read(self, i))
    alarm(30)
    it = iter(pipeline.packed_rows(str(tmp_path / "data"), "train", seq_len=SEQ, packer=packer,
                                   seed=0, batch_size=8))
    rows = [next(it) for _ in range(4)]
    alarm(0)
    # A row holds at most SEQ pairs and a document gives at least 6 ("hello": BOS + 5 + EOS), so
    # 4 rows take at most 4 * (SEQ // 6 + 1) documents; grain reads up to 64 ahead of them.
    assert len(reads) <= 4 * (SEQ // 6 + 1) + 64
    # The split repeats to fill rows: the packers close a row only when the next piece (at most
    # 17 pairs, the longest document) does not fit in it.
    assert all(int(r["loss_mask"].sum()) > SEQ - 17 for r in rows)
