"""A saved data-iterator state resumes only under the values of the keys its packer's rows depend
on (packing.PACKER_REGISTRY's row_keys): each key of each packer, changed between save and
resume, is announced as a restart, and restoring the state regardless would skip and repeat
tokens; with nothing changed the resume is exact.

The dataset is written here with every target token unique (document d holds BOS then ids no
other document holds), one row per batch, one epoch: an uninterrupted run sees every target
exactly once, so a resumed run is right exactly when it sees the same multiset of targets.
"""

import collections
import json

import jax
import numpy as np
import pytest

from configs import base
from longctx.data import packing, pipeline, prepare
from longctx.parallel import mesh as mesh_lib
from longctx.train import checkpoint_compat as compat

SEQ, SP, BLOCK = 64, 2, 16  # shards of 32 tokens, two blocks each
SAVED_AFTER = 5  # rows read before the save
PAD, BOS = 1, 2
# Each key changed to a value under which the packer packs other rows. seq_len stays a multiple of
# sp and block sizes divide the shard, as config.validate requires.
CHANGED = {packing.SEQ_LEN: 128, packing.SP: 4, packing.BLOCK_SIZE: 8, packing.BINS: None}


@pytest.fixture(scope="module")
def unique_dir(tmp_path_factory):
    """90 documents of 2 to 200 tokens (a fifth longer than a row), every target id unique."""
    from array_record.python.array_record_module import ArrayRecordWriter

    root = tmp_path_factory.mktemp("unique_targets")
    rng = np.random.default_rng(0)
    lengths = [int(rng.integers(SEQ + 1, 200)) if i % 5 == 0 else int(rng.integers(2, SEQ // 2))
               for i in range(90)]
    writer = ArrayRecordWriter(str(root / "train-00000.array_record"), "group_size:1")
    next_id = 3
    for n in lengths:
        doc = np.concatenate([[BOS], np.arange(next_id, next_id + n - 1)]).astype("<i4")
        writer.write(doc.tobytes())
        next_id += n - 1
    writer.close()
    counts = {"num_documents": len(lengths), "num_tokens": sum(lengths)}
    meta = {"tokenizer": "unique-ids (a test's)", "vocab_size": next_id, "bos_id": BOS,
            "eos_id": BOS, "pad_id": PAD,
            "splits": {"train": {"files": [{"path": "train-00000.array_record", **counts}], **counts},
                       "validation": {"files": [], "num_documents": 0, "num_tokens": 0}}}
    (root / prepare.METADATA).write_text(json.dumps(meta))
    return str(root)


def _config(packer, **keys):
    """A one-row-per-batch config with `keys` (packing's key names) changed."""
    c = base.get_config("tiny")
    c.data.update(seq_len=keys.get(packing.SEQ_LEN, SEQ), global_batch_size=1, packer=packer,
                  num_workers=0, prefetch_buffer_size=0)
    c.mesh.update(dp=1, fsdp=1, sp=keys.get(packing.SP, SP))
    c.attention.block_size = keys.get(packing.BLOCK_SIZE, BLOCK)
    return c


def _iterator(config, data_dir):
    mesh = mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:config.mesh.sp])
    return pipeline.make_batch_iterator(config, mesh, layout="contiguous", data_dir=data_dir,
                                        num_epochs=1)


def _rows(iterator):
    """This process's rows until the epoch ends."""
    out = []
    while True:
        try:
            out.append(iterator.next_local())
        except StopIteration:
            return out


def _targets(rows) -> collections.Counter:
    return collections.Counter(int(t) for r in rows for t in r["targets"][r["loss_mask"] > 0])


def _saved_run(packer, data_dir):
    """(every row of an uninterrupted epoch, the state after SAVED_AFTER rows, the metadata a
    checkpoint saves with it, the config)."""
    config = _config(packer)
    it = _iterator(config, data_dir)
    rows = [it.next_local() for _ in range(SAVED_AFTER)]
    state = json.loads(json.dumps(it.get_state()))  # as Orbax writes it
    metadata = json.loads(json.dumps({"process_count": 1, "mesh": {"dp": 1, "fsdp": 1, "sp": SP},
                                      compat.DATA_STREAM: it.stream_record()}))
    rows += _rows(it)
    it.close()
    return rows, state, metadata, config


def _resume(config, data_dir, state, saved_metadata, saved_config):
    """(the mismatch data_state_mismatch finds, the rows the state restored regardless yields,
    this run's packing settings)."""
    it = _iterator(config, data_dir)
    record = it.stream_record()
    why = compat.data_state_mismatch(saved_config.to_dict(), saved_metadata, config.to_dict(),
                                     record, 1)
    it.set_state(state)
    rows = _rows(it)
    it.close()
    return why, rows, record["packing"]


def _changed(packer, key, monkeypatch):
    """The config with `key` changed; the bins, which no config key sets alone, through the
    calibration (as a longctx that counts them otherwise would)."""
    if key == packing.BINS:
        calibrated = packing.num_packing_bins
        monkeypatch.setattr(packing, "num_packing_bins", lambda *a: calibrated(*a) // 4)
        return _config(packer)
    return _config(packer, **{key: CHANGED[key]})


@pytest.mark.parametrize("packer,key", [(p, k) for p in packing.PACKERS
                                        for k in packing.PACKER_REGISTRY[p].row_keys])
def test_a_changed_packing_key_restarts_where_restoring_would_skip_and_repeat(
        unique_dir, packer, key, monkeypatch):
    full, state, metadata, saved_config = _saved_run(packer, unique_dir)
    expected = _targets(full)
    assert set(expected.values()) == {1}  # the uninterrupted epoch: every target once

    why, rest, settings = _resume(_changed(packer, key, monkeypatch), unique_dir, state, metadata,
                                  saved_config)
    seen = _targets(full[:SAVED_AFTER] + rest)
    missed = sum((expected - seen).values())
    repeated = sum((seen - expected).values())
    assert missed + repeated > 0, "the state, restored regardless, resumed exactly"

    then, now = metadata[compat.DATA_STREAM]["packing"][key], settings[key]
    if key in compat.STREAM_KEYS:  # data.seq_len defines the stream before any packer reads it
        assert why == f"belongs to another data stream ({key}: checkpoint {then!r} vs config {now!r})"
    else:
        assert then != now
        assert why == f"was packed into rows under other settings ({key}: {then!r} then vs {now!r} now)"


@pytest.mark.parametrize("packer", packing.PACKERS)
def test_with_no_key_changed_the_resume_is_exact(unique_dir, packer):
    full, state, metadata, saved_config = _saved_run(packer, unique_dir)
    assert set(metadata[compat.DATA_STREAM]["packing"]) == set(packing.PACKER_REGISTRY[packer].row_keys)
    why, rest, _ = _resume(_config(packer), unique_dir, state, metadata, saved_config)
    assert why is None
    assert len(rest) == len(full) - SAVED_AFTER
    for a, b in zip(rest, full[SAVED_AFTER:]):
        for k in packing.KEYS:
            np.testing.assert_array_equal(a[k], b[k])


def _without_packing_record(metadata):
    """The metadata an older longctx saved: the same stream record, no packing settings."""
    old = json.loads(json.dumps(metadata))
    del old[compat.DATA_STREAM]["packing"]
    return old


def test_a_state_saved_before_the_record_restores_as_before_unless_its_config_and_mesh_differ(unique_dir):
    """An older checkpoint (tests/fixtures/checkpoint_2373a90 is one) has no packing settings;
    those its config and saved mesh fix are compared (sp and the block size, which shard_balanced
    re-packs by), and the bins, which nothing saved fixes, are not: with nothing changed it
    restores as it always did."""
    _, state, metadata, saved_config = _saved_run("shard_balanced", unique_dir)
    old = _without_packing_record(metadata)
    assert _resume(_config("shard_balanced"), unique_dir, state, old, saved_config)[0] is None
    why = _resume(_config("shard_balanced", **{packing.SP: 4}), unique_dir, state, old, saved_config)[0]
    assert why == "was packed into rows under other settings (mesh.sp: 2 then vs 4 now)"
    why = _resume(_config("shard_balanced", **{packing.BLOCK_SIZE: 8}), unique_dir, state, old,
                  saved_config)[0]
    assert why == "was packed into rows under other settings (attention.block_size: 16 then vs 8 now)"
    # best_fit's rows depend on neither: another sp restores as before.
    _, state, metadata, saved_config = _saved_run("best_fit", unique_dir)
    old = _without_packing_record(metadata)
    assert _resume(_config("best_fit", **{packing.SP: 4}), unique_dir, state, old, saved_config)[0] is None


def _checkpoint_config(**keys):
    config = _config("shard_balanced", **keys)
    config.model.update(num_layers=1, vocab_size=4096)  # the unique ids fit
    return config


def _mesh(config):
    return mesh_lib.make_mesh(config.mesh, devices=jax.devices()[:config.mesh.sp])


def _save(config, workdir, data_dir, seed_offset=0):
    """A checkpoint of step 1 after one batch of an iterator made with `seed_offset` (as a run
    that restarted its stream at that step makes it); returns the batches that iterator goes on
    to yield."""
    from longctx.train import checkpoint as checkpoint_lib
    from longctx.train import state as train_state

    mesh = _mesh(config)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        iterator = pipeline.make_batch_iterator(config, mesh, layout="contiguous", data_dir=data_dir,
                                                seed_offset=seed_offset)
        iterator.next_local()
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        assert checkpointer.maybe_save(1, setup.init(jax.random.PRNGKey(0)), iterator, force=True)
        checkpointer.close()
        following = [iterator.next_local() for _ in range(4)]
        iterator.close()
    return following


def _checkpoint_resume(config, workdir, data_dir):
    """(the note restore_or_init gives, the first 4 batches of the iterator it returns)."""
    from longctx.train import checkpoint as checkpoint_lib
    from longctx.train import state as train_state

    mesh = _mesh(config)
    setup = train_state.make_setup(config, mesh, "contiguous")
    checkpointer = checkpoint_lib.Checkpointer(workdir, config)
    with jax.set_mesh(mesh):
        _, iterator, note = checkpointer.restore_or_init(
            setup, lambda seed_offset=0: pipeline.make_batch_iterator(
                config, mesh, layout="contiguous", data_dir=data_dir, seed_offset=seed_offset))
    checkpointer.close()
    batches = [iterator.next_local() for _ in range(4)]
    iterator.close()
    return note, batches


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in packing.KEYS)


def test_a_checkpoint_resumed_under_another_sp_restarts_its_stream_with_one_line(unique_dir, tmp_path):
    """Through the checkpointer: saved by shard_balanced at sp=2, resumed at sp=4, the note is the
    one every data mismatch gets; at sp=2 the state is restored."""
    workdir = str(tmp_path / "w")
    following = _save(_checkpoint_config(), workdir, unique_dir)
    note, batches = _checkpoint_resume(_checkpoint_config(), workdir, unique_dir)
    assert note.endswith("(step 1), data iterator included"), note
    assert _same(batches, following)
    note, _ = _checkpoint_resume(_checkpoint_config(**{packing.SP: 4}), workdir, unique_dir)
    assert note.endswith(
        "(step 1); the data iterator state was packed into rows under other settings (mesh.sp: 2 "
        "then vs 4 now), so data restarts from a fresh shuffle seeded with step 1"), note


def test_a_stream_restarted_at_a_step_resumes_as_that_stream(unique_dir, tmp_path):
    """A run whose data restarted at step 7 (a shuffle seeded with 7) saves its iterator's state;
    a later resume must continue that stream: restored into the stream of seed offset 0 the same
    state is another stream's position."""
    workdir = str(tmp_path / "w")
    following = _save(_checkpoint_config(), workdir, unique_dir, seed_offset=7)
    note, batches = _checkpoint_resume(_checkpoint_config(), workdir, unique_dir)
    assert note.endswith("(step 1), data iterator included"), note
    assert _same(batches, following)


def test_an_iterator_of_another_seed_offset_is_a_mismatch(unique_dir):
    """(The checkpointer builds the resumed iterator with the saved offset; were it not, the state
    would stand at its position in another order of the documents.)"""
    _, state, metadata, saved_config = _saved_run("best_fit", unique_dir)
    metadata[compat.DATA_STREAM]["seed_offset"] = 7
    assert compat.saved_seed_offset(metadata) == 7
    assert _resume(_config("best_fit"), unique_dir, state, metadata, saved_config)[0] == (
        "belongs to the stream shuffled with seed offset 7 (data.shuffle_seed + the step it "
        "restarted at) and this iterator's offset is 0")
    del metadata[compat.DATA_STREAM]["seed_offset"]  # saved before offsets were recorded
    assert compat.saved_seed_offset(metadata) == 0
    assert _resume(_config("best_fit"), unique_dir, state, metadata, saved_config)[0] is None
