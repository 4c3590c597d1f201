"""make_batch_iterator: global sharded batches, determinism, save/restore, bad input."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import base
from longctx.data import (layout_sample, load_metadata, make_batch_iterator, packed_rows, prepare,
                          resolve_dataset)
from longctx.data.packing import PACKERS, PermuteLayout
from longctx.data.pipeline import batched
from longctx.data.tokenizer import BYTE_BOS
from longctx.parallel import layout as layout_lib
from longctx.parallel import mesh as mesh_lib
from tests import ROOT

SEQ = 64


def tiny_config(**data):
    c = base.get_config("tiny")
    c.data.update(dict(seq_len=SEQ, global_batch_size=4, packer="best_fit", num_workers=0,
                       prefetch_buffer_size=2), **data)
    return c


def mesh_of(config):
    return mesh_lib.make_mesh(config.mesh)  # tiny: dp=1, fsdp=2, sp=4 on 8 CPU devices


def take(it, n):
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_global_batches_sharded_and_laid_out(data_dir):
    c = tiny_config()
    mesh = mesh_of(c)
    it = make_batch_iterator(c, mesh, split="train", layout="zigzag", data_dir=data_dir)
    batch = next(it)
    assert set(batch) == {"tokens", "segment_ids", "positions", "targets", "loss_mask"}
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("dp", "fsdp"), "sp"))
    for v in batch.values():
        assert v.shape == (4, SEQ) and v.dtype == np.int32
        assert v.sharding.is_equivalent_to(want, 2)
    # The same seed in the contiguous layout gives the same rows, permuted.
    nat = next(make_batch_iterator(c, mesh, split="train", layout="contiguous", data_dir=data_dir))
    perm = layout_lib.permutation("zigzag", SEQ, 4)
    for k in batch:
        assert np.array_equal(np.asarray(batch[k]), np.asarray(nat[k])[:, perm])
    # Natural order (the layout undone): positions count 0, 1, 2, ... within each segment.
    inv = layout_lib.inverse_permutation(perm)
    natural = {k: np.asarray(batch[k])[:, inv] for k in ("segment_ids", "positions")}
    assert_positions_count_within_segments(natural["segment_ids"], natural["positions"])
    # Device (fsdp=f, sp=d) holds rows [2f, 2f+2) and the global positions perm[d*16:(d+1)*16].
    L = SEQ // 4
    for f in range(2):
        for d in range(4):
            device = mesh.devices[0, f, d]
            for k in ("positions", "segment_ids"):
                (shard,) = [s for s in batch[k].addressable_shards if s.device == device]
                want = natural[k][2 * f:2 * f + 2][:, perm[d * L:(d + 1) * L]]
                np.testing.assert_array_equal(np.asarray(shard.data), want, err_msg=f"{k} on fsdp={f}, sp={d}")
    it.close()


def assert_positions_count_within_segments(segment_ids, positions):
    """Rows in natural order: real tokens (segment id > 0) come first with non-decreasing ids, then
    padding (id 0); within each segment (a run of one id) positions are 0, 1, 2, ..."""
    for row, (seg, pos) in enumerate(zip(segment_ids, positions)):
        n = int((seg != 0).sum())
        assert (seg[:n] != 0).all() and (seg[n:] == 0).all(), f"row {row}: padding inside the row: {seg}"
        assert (np.diff(seg[:n]) >= 0).all(), f"row {row}: segment ids go back: {seg}"
        starts = np.flatnonzero(np.diff(seg[:n], prepend=-1))  # the first token of each segment
        lengths = np.diff(np.append(starts, n))
        expected = np.arange(n) - np.repeat(starts, lengths)
        np.testing.assert_array_equal(pos[:n], expected, err_msg=f"row {row}: segment ids {seg}")


@pytest.mark.parametrize("packer", ["best_fit", "concat_then_split", "first_fit"])
def test_positions_restart_at_every_segment(data_dir, packer):
    """Every packer, several batches, laid out and back: positions follow the segment ids."""
    c = tiny_config(packer=packer)
    mesh = mesh_of(c)
    it = make_batch_iterator(c, mesh, split="train", layout="striped", data_dir=data_dir)
    inv = layout_lib.inverse_permutation(layout_lib.permutation("striped", SEQ, 4))
    segments = 0
    for batch in take(it, 4):
        assert_positions_count_within_segments(batch["segment_ids"][:, inv], batch["positions"][:, inv])
        segments += sum(len(np.unique(row[row > 0])) for row in batch["segment_ids"])
    assert segments > 4 * 4  # packed: more documents than rows
    it.close()


def test_same_seed_same_batches_and_seed_offset_changes_order(data_dir):
    c = tiny_config()
    mesh = mesh_of(c)
    run = lambda **kw: take(make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir,
                                                **kw), 3)
    a, b, other = run(), run(), run(seed_offset=1)
    assert same(a, b)
    assert not same(a, other)


def test_layout_sample_is_the_first_train_rows_whoever_reads_it(data_dir):
    """The rows attention.layout='auto' is chosen on: the train split's first packed rows in the
    run's shuffled order, natural order, the same at every call (every host, every resume),
    whatever this process's data shard or batch size."""
    config = tiny_config(shuffle_seed=3)
    sample = layout_sample(config, data_dir)
    assert sample.shape == (8, SEQ) and sample.dtype == np.int32
    other_batch = tiny_config(shuffle_seed=3, global_batch_size=8)
    np.testing.assert_array_equal(sample, layout_sample(other_batch, data_dir))
    first = iter(packed_rows(data_dir, "train", seq_len=SEQ, packer="best_fit", seed=3))
    np.testing.assert_array_equal(sample, np.stack([next(first)["segment_ids"] for _ in range(8)]))
    assert np.all(np.diff(sample, axis=1)[sample[:, 1:] > 0] >= 0)  # natural order: ids never fall
    assert not np.array_equal(sample, layout_sample(tiny_config(shuffle_seed=4), data_dir))


def test_validation_is_repeatable(data_dir):
    c = tiny_config()
    mesh = mesh_of(c)
    run = lambda: take(make_batch_iterator(c, mesh, split="validation", layout="striped",
                                           data_dir=data_dir), 4)
    assert same(run(), run())


@pytest.mark.parametrize("packer,workers", [("best_fit", 0), ("concat_then_split", 0),
                                            ("first_fit", 2)])
def test_restore_mid_epoch_yields_identical_next_batches(data_dir, packer, workers):
    c = tiny_config(packer=packer, num_workers=workers)
    mesh = mesh_of(c)
    it = make_batch_iterator(c, mesh, layout="zigzag", data_dir=data_dir)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))  # must survive JSON (Orbax writes it so)
    expected = take(it, 5)
    it.close()
    fresh = make_batch_iterator(c, mesh, layout="zigzag", data_dir=data_dir)
    fresh.set_state(state)
    assert same(take(fresh, 5), expected)
    fresh.close()


RESUME_BATCHES = 8


@pytest.fixture(scope="module")
def long_docs_dir(tmp_path_factory):
    """16 documents of SEQ+1 to 4*SEQ characters: whatever the shuffle and the data shard, the
    stream starts inside a document cut into full-length pieces and a partial one."""
    root = tmp_path_factory.mktemp("long_docs")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "".join(rng.choice(list("abcdefgh "), rng.integers(SEQ + 1, 4 * SEQ)))})
             for _ in range(16)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare.prepare([str(root / "docs.jsonl")], str(root / "data"), val_fraction=0.0,
                    progress=False)
    return str(root / "data")


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("shard_index,shard_count", [(0, 1), (0, 2), (1, 2)])
def test_resume_after_every_batch_is_exact(long_docs_dir, packer, shard_index, shard_count):
    """A state saved after any batch k (JSON round trip, as Orbax writes it) restores into a fresh
    iterator that yields exactly the uninterrupted run's batches k+1, ...: also between the
    pieces of a long document (concat-then-split lost a piece there, see packing.JsonRestorable)."""
    def make():
        rows = packed_rows(long_docs_dir, "train", seq_len=SEQ, packer=packer, seed=3,
                           shard_index=shard_index, shard_count=shard_count, batch_size=2)
        return iter(batched(rows, 2, PermuteLayout(None), prefetch_buffer_size=0))

    it, run, states = make(), [], []
    for _ in range(RESUME_BATCHES):
        run.append(next(it))
        states.append(json.loads(json.dumps(it.get_state())))
    # The saved states cover long documents cut into pieces (a row that starts mid-document).
    assert any(batch["tokens"][r, 0] != BYTE_BOS for batch in run for r in range(2))
    for k in range(1, RESUME_BATCHES):
        fresh = make()
        fresh.set_state(states[k - 1])
        assert same([next(fresh) for _ in range(RESUME_BATCHES - k)], run[k:]), (
            f"restored after batch {k}")


@pytest.mark.parametrize("dataset,packer,saved_after", [
    ("data_dir", "best_fit", 2),
    ("long_docs_dir", "concat_then_split", 1),  # between the pieces of the first document
])
def test_orbax_checkpoint_of_grain_iterator(request, tmp_path, dataset, packer, saved_after):
    import grain
    import orbax.checkpoint as ocp

    data_dir = request.getfixturevalue(dataset)
    c = tiny_config(packer=packer)
    mesh = mesh_of(c)
    it = make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir)
    take(it, saved_after)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(saved_after,
              args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it.grain_iterator)))
    mngr.wait_until_finished()
    expected = take(it, 5)
    fresh = make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir)
    mngr.restore(saved_after,
                 args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh.grain_iterator)))
    assert same(take(fresh, 5), expected)
    mngr.close()


def test_bad_config_fails_with_one_sentence(data_dir):
    """(seq_len against sp is config.validate's rule, tests/test_config.py; model.vocab_size against
    the tokenizer is the trainer's, tests/train/test_train_safety.py.)"""
    mesh = mesh_of(tiny_config())
    with pytest.raises(ValueError, match="global_batch_size=3"):
        make_batch_iterator(tiny_config(global_batch_size=3), mesh, layout="contiguous",
                            data_dir=data_dir)
    with pytest.raises(ValueError, match="concrete layout"):
        make_batch_iterator(tiny_config(), mesh, layout="auto", data_dir=data_dir)
    c = tiny_config()
    c.data.path = os.path.join(data_dir, "nope")
    with pytest.raises(FileNotFoundError, match="data.path="):
        resolve_dataset(c)


def copy_of(data_dir, tmp_path):
    d = str(tmp_path / "copy")
    shutil.copytree(data_dir, d)
    return d, load_metadata(d)


def test_corrupt_array_record_is_named(data_dir, tmp_path):
    d, meta = copy_of(data_dir, tmp_path)
    name = meta["splits"]["train"]["files"][0]["path"]
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, name)) // 2)
    with pytest.raises(ValueError, match=f"{name}.*corrupt"):
        make_batch_iterator(tiny_config(), mesh_of(tiny_config()), layout="contiguous", data_dir=d)


def test_token_ids_beyond_vocab_are_named(data_dir, tmp_path):
    d, meta = copy_of(data_dir, tmp_path)
    meta["vocab_size"] = 128  # the stored BOS (256) is now out of range
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump(meta, f)
    it = make_batch_iterator(tiny_config(), mesh_of(tiny_config()), layout="contiguous", data_dir=d)
    with pytest.raises(ValueError, match=r"train-00000.array_record record \d+ has token id 25[67] outside"):
        next(it)


def test_missing_metadata_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata.json does not exist"):
        load_metadata(str(tmp_path))


def test_embedded_corpus_prepared_once_and_cached(tmp_path):
    c = tiny_config()
    c.data.cache_dir = str(tmp_path)
    d = resolve_dataset(c)
    meta = load_metadata(d)
    assert meta["splits"]["validation"]["num_documents"] > 0
    assert meta["splits"]["train"]["num_documents"] > 100
    assert meta["vocab_size"] == 259 and meta["tokenizer"] == "byte"
    stamp = os.path.getmtime(os.path.join(d, "metadata.json"))
    assert resolve_dataset(c) == d and os.path.getmtime(os.path.join(d, "metadata.json")) == stamp
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    # Byte-identical when prepared again elsewhere.
    again = prepare.prepare_stdlib(str(tmp_path / "again"))
    for f in os.listdir(d):
        with open(os.path.join(d, f), "rb") as a, open(os.path.join(again, f), "rb") as b:
            assert a.read() == b.read(), f


def test_embedded_corpus_survives_a_race(tmp_path):
    """Two processes preparing the same cache at once both end with the same complete dataset."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[2]); from longctx.data import prepare; "
            "print(prepare.prepare_stdlib(sys.argv[1]))")
    root = ROOT
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), root],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and os.path.isdir(outs[0])
    assert load_metadata(outs[0])["splits"]["train"]["num_documents"] > 100
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(outs[0])]  # no temporaries left
