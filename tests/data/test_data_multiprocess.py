"""Two real processes (launch/local.py, 2 x 4 CPU devices): who reads which rows.

- mesh dp=2, sp=4: each process holds one dp block, so the two read disjoint documents, and the
  global arrays are the two local halves stacked;
- mesh dp=1, sp=8: the ring spans both processes, so both read the same rows;
- a 3-source mixture (data.sources) on both meshes: what the two processes read together is what
  one process reads (the same global batches on dp=1, sp=8; on dp=2, sp=4 the one-process
  streams of data shards 0 and 1 of 2, stacked);
- a checkpoint saved on one of these meshes and resumed on the other: the process -> data shard
  map changed, so the saved iterator states (one per process) must not be restored (the two
  processes of the new sp group would feed different rows into one sequence); the stream
  restarts, seeded by the step, and the resume note says why. On the same mesh it continues.
This file is also the worker: run as a script it writes what its process saw to an .npz.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import ROOT
from tests.data.mixture_sources import prepare_sources

LOCAL = os.path.join(ROOT, "launch", "local.py")
SEQ, BATCH, STEPS = 64, 4, 3
JOB_SEPARATOR = "+"  # between the jobs of one launch (_launch_two)


def worker(data_dir: str, out_dir: str, dp: int, sp: int) -> None:
    import jax

    from configs import base
    from longctx.data import make_batch_iterator
    from longctx.parallel import mesh as mesh_lib
    from longctx.parallel import processes

    c = base.get_config("tiny")
    mesh_lib.maybe_initialize_distributed(c.distributed)
    c.mesh.update(dp=dp, fsdp=1, sp=sp)
    c.data.update(seq_len=SEQ, global_batch_size=BATCH, packer="first_fit")
    mesh = mesh_lib.make_mesh(c.mesh)
    it = make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir)
    full = []
    for _ in range(STEPS):
        batch = next(it)
        # The global array, gathered to every process, to compare with the local rows.
        full.append(processes.replicated(batch["tokens"]))
    it2 = make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir)
    local = [it2.next_local()["tokens"] for _ in range(STEPS)]
    np.savez(os.path.join(out_dir, f"p{jax.process_index()}.npz"), local=np.stack(local),
             full=np.stack(full), shard=np.array([it.shard.index, it.shard.count]))


def mixture_config(sources_json: str, dp: int, sp: int):
    from configs import base

    c = base.get_config("tiny")
    c.mesh.update(dp=dp, fsdp=1, sp=sp)
    c.data.update(seq_len=SEQ, global_batch_size=BATCH, packer="best_fit", prefetch_buffer_size=0)
    with c.unlocked():
        c.data.sources = json.loads(sources_json)
    return c


def mixture_worker(sources_json: str, out_dir: str, dp: int, sp: int) -> None:
    """The global batches of a mixture, gathered to every process (each process's own rows beside)."""
    import jax

    from longctx.data import make_batch_iterator
    from longctx.parallel import mesh as mesh_lib
    from longctx.parallel import processes

    c = mixture_config(sources_json, dp, sp)
    mesh_lib.maybe_initialize_distributed(c.distributed)
    mesh = mesh_lib.make_mesh(c.mesh)
    it = make_batch_iterator(c, mesh, layout="contiguous", data_dir="")
    batches = [next(it) for _ in range(STEPS)]
    it.close()
    full = {k: np.stack([processes.replicated(b[k]) for b in batches]) for k in batches[0]}
    np.savez(os.path.join(out_dir, f"p{jax.process_index()}.npz"), shard=np.array([it.shard.index, it.shard.count]),
             **full)


MESHES = {"dp": (2, 4), "sp": (1, 8)}  # (dp, sp), fsdp=1
SAVED_AT = 2  # batches read before the save


def resume_worker(data_dir: str, out_dir: str, saved_on: str, resumed_on: str, packer: str) -> None:
    """Reads SAVED_AT batches on mesh `saved_on` and checkpoints (with a freshly initialised train
    state of a 1-layer model: only the data iterator matters here), then resumes on `resumed_on`
    with the trainer's restore path and records the note and the next STEPS local batches."""
    import jax

    from configs import base
    from longctx.data import make_batch_iterator
    from longctx.parallel import mesh as mesh_lib
    from longctx.train import checkpoint as checkpoint_lib
    from longctx.train import state as train_state

    c = base.get_config("tiny")
    mesh_lib.maybe_initialize_distributed(c.distributed)
    c.model.num_layers = 1
    c.data.update(seq_len=SEQ, global_batch_size=BATCH, packer=packer)
    workdir = os.path.join(out_dir, "workdir")

    def start(mesh_name):
        dp, sp = MESHES[mesh_name]
        c.mesh.update(dp=dp, fsdp=1, sp=sp)
        mesh = mesh_lib.make_mesh(c.mesh)
        checkpointer = checkpoint_lib.Checkpointer(workdir, c)

        def make_iterator(seed_offset=0):
            return make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir,
                                       seed_offset=seed_offset)

        with jax.set_mesh(mesh):
            state, it, note = checkpointer.restore_or_init(
                train_state.make_setup(c, mesh, "contiguous"), make_iterator)
        return checkpointer, state, it, note, make_iterator

    checkpointer, state, it, _, _ = start(saved_on)
    before = [it.next_local()["tokens"] for _ in range(SAVED_AT)]
    checkpointer.maybe_save(SAVED_AT, state, it, force=True)
    after_save = [it.next_local()["tokens"] for _ in range(STEPS)]  # the uninterrupted stream
    checkpointer.close()
    it.close()

    checkpointer, _, it, note, make_iterator = start(resumed_on)
    resumed = [it.next_local()["tokens"] for _ in range(STEPS)]
    fresh_it = make_iterator(seed_offset=SAVED_AT)
    fresh = [fresh_it.next_local()["tokens"] for _ in range(STEPS)]
    checkpointer.close()
    it.close()
    fresh_it.close()
    p = jax.process_index()
    np.savez(os.path.join(out_dir, f"p{p}.npz"), before=np.stack(before),
             uninterrupted=np.stack(after_save), resumed=np.stack(resumed), fresh=np.stack(fresh))
    with open(os.path.join(out_dir, f"p{p}.json"), "w") as f:
        json.dump({"note": note}, f)


def _launch_two(*jobs):
    """One launch of two processes running `jobs` (argument lists for the worker) one after the
    other: a launch costs each process its imports and jax.distributed's start-up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCTX_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    args = [str(a) for i, job in enumerate(jobs) for a in ((JOB_SEPARATOR,) if i else ()) + tuple(job)]
    r = subprocess.run([sys.executable, LOCAL, "--num-processes", "2", "--devices-per-process", "4",
                        "--", sys.executable, os.path.abspath(__file__), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def run_two(data_dir, *out_dirs_and_meshes):
    """Per (out_dir, dp, sp): what each of the two processes read."""
    _launch_two(*[("rows", data_dir, out_dir, dp, sp) for out_dir, dp, sp in out_dirs_and_meshes])
    return [[np.load(out_dir / f"p{i}.npz") for i in range(2)] for out_dir, _, _ in out_dirs_and_meshes]


def resume_two(data_dir, *out_dirs_and_meshes, packer):
    """Per (out_dir, saved_on, resumed_on): each process's streams and resume note."""
    for out_dir, _, _ in out_dirs_and_meshes:
        out_dir.mkdir()
    _launch_two(*[("resume", data_dir, out_dir, saved_on, resumed_on, packer)
                  for out_dir, saved_on, resumed_on in out_dirs_and_meshes])
    return [([np.load(out_dir / f"p{i}.npz") for i in range(2)],
             [json.loads((out_dir / f"p{i}.json").read_text())["note"] for i in range(2)])
            for out_dir, _, _ in out_dirs_and_meshes]


@pytest.mark.slow
def test_two_processes_read_their_own_rows(data_dir, tmp_path):
    (tmp_path / "dp").mkdir()
    (tmp_path / "sp").mkdir()
    (p0, p1), (q0, q1) = run_two(data_dir, (tmp_path / "dp", 2, 4), (tmp_path / "sp", 1, 8))
    assert p0["shard"].tolist() == [0, 2] and p1["shard"].tolist() == [1, 2]
    assert p0["local"].shape == (STEPS, BATCH // 2, SEQ)
    # Disjoint documents: no row of one process appears in the other.
    rows0 = {r.tobytes() for r in p0["local"].reshape(-1, SEQ)}
    rows1 = {r.tobytes() for r in p1["local"].reshape(-1, SEQ)}
    assert not rows0 & rows1
    # The global batch is process 0's rows then process 1's, seen identically by both.
    want = np.concatenate([p0["local"], p1["local"]], axis=1)
    assert np.array_equal(p0["full"], want) and np.array_equal(p1["full"], want)

    assert q0["shard"].tolist() == q1["shard"].tolist() == [0, 1]
    assert np.array_equal(q0["local"], q1["local"])  # one sp group: the same rows
    assert np.array_equal(q0["full"], q0["local"]) and np.array_equal(q1["full"], q1["local"])


def _restarts(note: str, shards_then: str, shards_now: str) -> bool:
    return note.endswith(
        f"(step {SAVED_AT}); the data iterator state was saved under another process -> data shard "
        f"map (process 0: {shards_then[0]} then, {shards_now[0]} now; process 1: {shards_then[1]} "
        f"then, {shards_now[1]} now), so data restarts from a fresh shuffle seeded with step {SAVED_AT}")


DP_SHARDS = ("data shard 0 of 2, batch rows 0-1", "data shard 1 of 2, batch rows 2-3")
SP_SHARDS = ("data shard 0 of 1, batch rows 0-3",) * 2


@pytest.mark.slow
def test_resume_across_a_mesh_change_restarts_the_stream(data_dir, tmp_path):
    """dp=2 -> sp spanning both processes, the reverse, and (the control) the same mesh again."""
    # dp=2 -> sp=8: the two processes now form one sp group and must feed the same rows. Restoring
    # their saved states (one per former dp block) would give each different rows.
    # concat_then_split: its Grain state counts the documents read, which differ between the two
    # dp blocks from the first batch on (first/best-fit record the start of the current packing
    # window, the same for both until a window closes).
    dp_to_sp, sp_to_dp, dp_to_dp = resume_two(
        data_dir, (tmp_path / "dp_to_sp", "dp", "sp"), (tmp_path / "sp_to_dp", "sp", "dp"),
        (tmp_path / "dp_to_dp", "dp", "dp"), packer="concat_then_split")
    (p0, p1), notes = dp_to_sp
    saved = [(tmp_path / "dp_to_sp" / "workdir" / "checkpoints" / str(SAVED_AT) / "data" /
              f"process_{i}-of-2.json").read_text() for i in range(2)]
    assert saved[0] != saved[1]  # restoring them would feed different rows into one sequence
    assert all(_restarts(n, DP_SHARDS, SP_SHARDS) for n in notes), notes
    assert np.array_equal(p0["resumed"], p1["resumed"])
    assert np.array_equal(p0["resumed"], p0["fresh"])  # the stream seeded by the step

    # sp=8 -> dp=2: each process reads its own documents again, from a stream seeded by the step.
    (p0, p1), notes = sp_to_dp
    assert all(_restarts(n, SP_SHARDS, DP_SHARDS) for n in notes), notes
    for p in (p0, p1):
        assert np.array_equal(p["resumed"], p["fresh"])
    assert not {r.tobytes() for r in p0["resumed"].reshape(-1, SEQ)} & {
        r.tobytes() for r in p1["resumed"].reshape(-1, SEQ)}

    # The same mesh: each process's state is restored and its stream continues exactly (also
    # concat_then_split's, saved while data shard 1 is inside its first document's pieces).
    (p0, p1), notes = dp_to_dp
    assert all(n.endswith(f"(step {SAVED_AT}), data iterator included") for n in notes), notes
    for p in (p0, p1):
        assert np.array_equal(p["resumed"], p["uninterrupted"])
        assert not np.array_equal(p["resumed"], p["fresh"])  # (else the test proves nothing)


@pytest.mark.slow
def test_shard_balanced_rows_are_the_same_on_both_hosts_of_a_ring_and_resume_exactly(data_dir, tmp_path):
    """data.packer=shard_balanced, the ring over both processes (sp=8, shards of 8 tokens): the
    two hosts pack the same rows, and after a save and restore each continues its stream exactly."""
    [((p0, p1), notes)] = resume_two(data_dir, (tmp_path / "sp_to_sp", "sp", "sp"),
                                     packer="shard_balanced")
    assert all(n.endswith(f"(step {SAVED_AT}), data iterator included") for n in notes), notes
    for key in ("before", "uninterrupted", "resumed"):
        assert np.array_equal(p0[key], p1[key]), key
    assert np.array_equal(p0["resumed"], p0["uninterrupted"])
    assert not np.array_equal(p0["resumed"], p0["fresh"])  # (else the test proves nothing)


def _one_process_rows(config, shard, steps: int) -> dict[str, np.ndarray]:
    """`[steps, rows, SEQ]` per key: the stream one process reads as `shard` (the contiguous
    layout: no permutation), through the same mixture and batching as make_batch_iterator."""
    from longctx.data import mixture, packing, pipeline

    rows, _ = mixture.mixture_rows(config, mixture.source_dirs(config), shard=shard, sp=config.mesh.sp)
    it = iter(pipeline.batched(rows, shard.local_batch_size, packing.PermuteLayout(None),
                               prefetch_buffer_size=0))
    batches = [next(it) for _ in range(steps)]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.slow
def test_two_processes_read_a_mixture_as_one_process_does(tmp_path):
    # (imported here, as in the workers: run as a script, this file sets up its devices first)
    from longctx.data import mixture, packing
    from longctx.data.sharding import DataShard
    from longctx.parallel import mesh as mesh_lib

    sources = json.dumps({n: {"path": d, "weight": w} for (n, d), w in
                          zip(sorted(prepare_sources(tmp_path).items()), (0.5, 0.3, 0.2))})
    for name in MESHES:
        (tmp_path / name).mkdir()
    _launch_two(*[("mixture", sources, tmp_path / name, dp, sp) for name, (dp, sp) in MESHES.items()])
    (p0, p1), (q0, q1) = [[np.load(tmp_path / name / f"p{i}.npz") for i in range(2)] for name in MESHES]

    # dp=1, sp=8: one sp group over both processes; the same batches as one process on that mesh.
    config = mixture_config(sources, *MESHES["sp"])
    mesh = mesh_lib.make_mesh(config.mesh)
    it = mixture.make_batch_iterator(config, mesh, layout="contiguous", data_dir="")
    one = [next(it) for _ in range(STEPS)]
    taken = it.get_state()["tokens"]
    it.close()
    assert sorted(taken) == ["books", "code", "web"] and min(taken.values()) > 0, taken
    assert q0["shard"].tolist() == q1["shard"].tolist() == [0, 1]
    for key in packing.KEYS:
        want = np.stack([np.asarray(b[key]) for b in one])
        assert np.array_equal(q0[key], want) and np.array_equal(q1[key], want), key

    # dp=2, sp=4: process i reads data shard i of 2 of every source, exactly as one process reads
    # that shard; the global batch is the two stacked, seen identically by both processes.
    config = mixture_config(sources, *MESHES["dp"])
    half = BATCH // 2
    shards = [_one_process_rows(config, DataShard(i, 2, i * half, (i + 1) * half), STEPS) for i in range(2)]
    assert p0["shard"].tolist() == [0, 2] and p1["shard"].tolist() == [1, 2]
    for key in packing.KEYS:
        want = np.concatenate([shards[0][key], shards[1][key]], axis=1)
        assert np.array_equal(p0[key], want) and np.array_equal(p1[key], want), key
    assert not np.array_equal(shards[0]["tokens"], shards[1]["tokens"])  # (disjoint documents)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # for configs/ (longctx itself is installed)
    from longctx.parallel import devices

    devices.configure_cpu_devices()
    args = sys.argv[1:]
    while args:
        job = args[:args.index(JOB_SEPARATOR)] if JOB_SEPARATOR in args else args
        args = args[len(job) + 1:]
        if job[0] == "resume":
            resume_worker(*job[1:6])
        elif job[0] == "mixture":
            mixture_worker(job[1], job[2], int(job[3]), int(job[4]))
        else:
            worker(job[1], job[2], int(job[3]), int(job[4]))
