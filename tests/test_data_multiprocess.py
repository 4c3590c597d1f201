"""Two real processes (launch/local.py, 2 x 4 CPU devices): who reads which rows.

- mesh dp=2, sp=4: each process holds one dp block, so the two read disjoint documents, and the
  global arrays are the two local halves stacked;
- mesh dp=1, sp=8: the ring spans both processes, so both read the same rows.
This file is also the worker: run as a script it writes what its process saw to an .npz.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = os.path.join(ROOT, "launch", "local.py")
SEQ, BATCH, STEPS = 64, 4, 3


def worker(data_dir: str, out_dir: str, dp: int, sp: int) -> None:
    sys.path.insert(0, ROOT)  # for configs/ (longctx itself is installed)
    from longctx import devices

    devices.configure_cpu_devices()
    import jax

    from configs import base
    from longctx import mesh as mesh_lib
    from longctx.data import make_batch_iterator

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
        full.append(np.asarray(jax.experimental.multihost_utils.process_allgather(
            batch["tokens"], tiled=True)))
    it2 = make_batch_iterator(c, mesh, layout="contiguous", data_dir=data_dir)
    local = [it2.next_local()["tokens"] for _ in range(STEPS)]
    np.savez(os.path.join(out_dir, f"p{jax.process_index()}.npz"), local=np.stack(local),
             full=np.stack(full), shard=np.array([it.shard.index, it.shard.count]))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from longctx.data import prepare
    from tests.test_data_packing import make_corpus

    root = tmp_path_factory.mktemp("mp")
    out = root / "data"
    prepare.prepare([str(make_corpus(root))], str(out), val_fraction=0.1, progress=False)
    return str(out)


def run_two(data_dir, out_dir, dp, sp):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGCTX_")}
    env["PYTHONPATH"] = ROOT
    r = subprocess.run([sys.executable, LOCAL, "--num-processes", "2", "--devices-per-process", "4",
                        "--", sys.executable, os.path.abspath(__file__), data_dir, str(out_dir),
                        str(dp), str(sp)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [np.load(out_dir / f"p{i}.npz") for i in range(2)]


@pytest.mark.slow
def test_two_processes_read_their_own_rows(data_dir, tmp_path):
    (tmp_path / "dp").mkdir()
    p0, p1 = run_two(data_dir, tmp_path / "dp", dp=2, sp=4)
    assert p0["shard"].tolist() == [0, 2] and p1["shard"].tolist() == [1, 2]
    assert p0["local"].shape == (STEPS, BATCH // 2, SEQ)
    # Disjoint documents: no row of one process appears in the other.
    rows0 = {r.tobytes() for r in p0["local"].reshape(-1, SEQ)}
    rows1 = {r.tobytes() for r in p1["local"].reshape(-1, SEQ)}
    assert not rows0 & rows1
    # The global batch is process 0's rows then process 1's, seen identically by both.
    want = np.concatenate([p0["local"], p1["local"]], axis=1)
    assert np.array_equal(p0["full"], want) and np.array_equal(p1["full"], want)

    (tmp_path / "sp").mkdir()
    q0, q1 = run_two(data_dir, tmp_path / "sp", dp=1, sp=8)
    assert q0["shard"].tolist() == q1["shard"].tolist() == [0, 1]
    assert np.array_equal(q0["local"], q1["local"])  # one sp group: the same rows
    assert np.array_equal(q0["full"], q0["local"]) and np.array_equal(q1["full"], q1["local"])


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
