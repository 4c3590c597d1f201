"""Checkpoint benchmark: how long an async save blocks the training loop, the whole save, a restore.

  .venv/bin/python benchmarks/bench_checkpoint.py               # writes docs/bench_checkpoint.{json,md}
  .venv/bin/python benchmarks/bench_checkpoint.py --d-model 1024 --num-layers 2 --saves 6

The train state (parameters + AdamW moments + step + rng, float32) of a model a few hundred MB
in size is built with `longctx.train.state.make_setup` on 8 virtual CPU devices (mesh dp=1, fsdp=8,
sp=1: every array sharded, as FSDP would) and saved through `longctx.train.checkpoint.Checkpointer`,
the code path the training loop uses: Orbax CheckpointManager, async, with the Grain iterator
state, config and metadata. Between saves a jitted, donated update touches every array of the
state, as a training step would (so each save sees new values and the donation path is used).

Per save:
  blocked  the time `Checkpointer.maybe_save` holds the caller (the loop waits this long);
  total    from that call until the checkpoint is committed (renamed into place);
  fraction blocked / total (target: under 0.10).
The first save also pays one-time set-up and is reported apart from the steady-state median.
Restore: a new Checkpointer's `restore_or_init` (state resharded onto the mesh, data iterator),
checked bitwise against the state that was saved last.
"""

from __future__ import annotations

from longctx import cli

cli.start()  # before jax is imported

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

TARGET_FRACTION = 0.10


def _config(args):
    c = bc.base_config("tiny")
    c.mesh.dp, c.mesh.fsdp, c.mesh.sp = 1, -1, 1
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = args.d_model, args.num_layers, args.mlp_dim
    c.model.num_heads, c.model.num_kv_heads, c.model.head_dim = args.d_model // 128, args.d_model // 128, 128
    c.model.vocab_size = args.vocab_size
    c.data.seq_len, c.data.global_batch_size = 512, 8
    c.attention.block_size = 64
    c.checkpoint.every_steps, c.checkpoint.max_to_keep, c.checkpoint.async_save = 1, 2, True
    return c


def _by_name(tree) -> dict:
    """Leaves by path name ("params/embed/value"), whatever the container types."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path): leaf
            for path, leaf in leaves}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--mlp-dim", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--steps-between", type=int, default=2, help="donated updates between saves")
    parser.add_argument("--workdir", default="", help="where to save (default: a fresh temporary directory)")
    parser.add_argument("--out", default=bc.DOCS, help="where the .json and .md go")
    args = parser.parse_args()
    cli.validated("the flags are fine")

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    from longctx.train import checkpoint as checkpoint_lib
    from longctx import data as data_lib
    from longctx.parallel import mesh as mesh_lib
    from longctx.train import state as train_state

    config = _config(args)
    mesh = mesh_lib.make_mesh(config.mesh)
    data_dir = data_lib.resolve_dataset(config)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)

    def make_iterator(seed_offset=0):
        return data_lib.make_batch_iterator(config, mesh, split="train", layout="contiguous",
                                            data_dir=data_dir, seed_offset=seed_offset)

    with jax.set_mesh(mesh):
        setup = train_state.make_setup(config, mesh, "contiguous")
        state = jax.block_until_ready(setup.init(jax.random.PRNGKey(0)))
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        num_params = sum(x.size for x in jax.tree.leaves(state.params))
        print(f"state: {nbytes / 1e6:.0f} MB ({num_params / 1e6:.1f}M parameters + AdamW moments), "
              f"mesh {dict(mesh.shape)}, {workdir}", flush=True)

        # Random values everywhere (fresh AdamW moments are zeros and would compress to nothing),
        # and a stand-in for train_step that changes every array, the state donated as the real
        # step's is.
        def randomize(s):
            leaves, tree = jax.tree.flatten(s)
            keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
            return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype)
                                             if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
                                             for k, x in zip(keys, leaves)])

        def step_fn(s):
            return jax.tree.map(lambda x: x * 0.999 + 1 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                                else x + 1, s)

        state = jax.block_until_ready(jax.jit(randomize, out_shardings=setup.state_shardings,
                                              donate_argnums=0)(state))
        update = jax.jit(step_fn, out_shardings=setup.state_shardings, donate_argnums=0)
        state = jax.block_until_ready(update(state))

        def host_copy(s):
            return jax.tree.map(lambda x: [np.array(sh.data, copy=True) for sh in x.addressable_shards], s)

        t0 = time.perf_counter()
        host_copy(state)
        host_copy_s = time.perf_counter() - t0

        iterator = make_iterator()
        next(iterator)
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        saves = []
        step = 0
        for i in range(args.saves):
            for _ in range(args.steps_between):
                state = update(state)
                step += 1
            jax.block_until_ready(state)
            if i == args.saves - 2:  # this save's arrays are donated to the next update mid-save
                mid_step, mid_expected = step, jax.tree.map(lambda x: np.array(x, copy=True), state)
            t0 = time.perf_counter()
            assert checkpointer.maybe_save(step, state, iterator, force=True)
            blocked = time.perf_counter() - t0
            if i < args.saves - 1:
                # The loop goes on while the save runs in the background (the state is donated).
                state = jax.block_until_ready(update(state))
                step += 1
            checkpointer.wait()
            total = time.perf_counter() - t0
            saves.append({"step": step if i == args.saves - 1 else step - 1, "blocked_s": round(blocked, 4), "total_s": round(total, 4),
                          "fraction": round(blocked / total, 4)})
            print(f"save {i + 1} (step {saves[-1]['step']}): blocked {blocked:.3f}s of {total:.3f}s "
                  f"({blocked / total:.1%})", flush=True)
        saved_state, saved_step = state, step
        checkpointer.close()
        iterator.close()

        t0 = time.perf_counter()
        checkpointer = checkpoint_lib.Checkpointer(workdir, config)
        restored, restored_iterator, note = checkpointer.restore_or_init(setup, make_iterator)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
        checkpointer.close()
        restored_iterator.close()
        assert note.startswith(f"resumed from {workdir}/checkpoints/{saved_step} "), note
        exact = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved_state)))
        assert exact, "restored state differs from the saved one"
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            mid = ckptr.restore(os.path.join(workdir, "checkpoints", str(mid_step), "state"))
        mid_exact = _by_name(mid).keys() == _by_name(mid_expected).keys() and all(
            np.array_equal(np.asarray(a), _by_name(mid_expected)[k]) for k, a in _by_name(mid).items())
        assert mid_exact, f"step {mid_step}: the checkpoint differs from the state it was saved from"
        print(f"restore: {restore_s:.3f}s ({note})", flush=True)

    steady = saves[1:] or saves
    blocked_med = statistics.median(s["blocked_s"] for s in steady)
    total_med = statistics.median(s["total_s"] for s in steady)
    size_on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                       os.walk(os.path.join(workdir, "checkpoints", str(saved_step))) for f in fs)
    result = {
        "command": bc.command_line(),
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
                    "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                    "jax": jax.__version__},
        "state_mb": round(nbytes / 1e6, 1), "num_params": int(num_params),
        "checkpoint_on_disk_mb": round(size_on_disk / 1e6, 1),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "host_copy_s": round(host_copy_s, 4),
        "saves": saves,
        "first_save": saves[0],
        "steady": {"blocked_s": blocked_med, "total_s": total_med,
                   "fraction": round(blocked_med / total_med, 4), "target_fraction": TARGET_FRACTION,
                   "meets_target": blocked_med / total_med < TARGET_FRACTION},
        "restore_s": round(restore_s, 4),
        "restore_bitwise_equal": exact,
        "saved_then_donated_mid_save_bitwise_equal": mid_exact,
    }
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    _write(result, args.out)


def _write(result, out_dir):
    bc.write_json(os.path.join(out_dir, "bench_checkpoint.json"), result)
    s, first = result["steady"], result["first_save"]
    rows = [f"| {i + 1} | {x['step']} | {x['blocked_s']:.3f} | {x['total_s']:.3f} | {x['fraction']:.1%} |"
            for i, x in enumerate(result["saves"])]
    md = [
        "# Checkpoint benchmark",
        "",
        f"Train state {result['state_mb']:.0f} MB ({result['num_params'] / 1e6:.1f}M float32 parameters + "
        f"AdamW moments; {result['checkpoint_on_disk_mb']:.0f} MB on disk), mesh {result['mesh']}, "
        f"{result['machine']['devices']} devices on {result['machine']['cpus']} CPU cores "
        f"(load average {result['machine']['load_avg_1m_at_end']} at the end), jax {result['machine']['jax']}.",
        "Saved through `longctx.train.checkpoint.Checkpointer` (Orbax CheckpointManager, async; Grain iterator "
        "state, config and metadata included).",
        "",
        "| save | step | blocked (s) | total (s) | blocked / total |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "| figure | value |",
        "|---|---|",
        f"| loop blocked per async save (median, saves 2+) | {s['blocked_s']:.3f} s |",
        f"| total time per save (median, saves 2+) | {s['total_s']:.3f} s |",
        f"| blocked fraction (target < {s['target_fraction']:.0%}) | {s['fraction']:.1%} "
        f"({'met' if s['meets_target'] else 'missed'}) |",
        f"| first save (one-time set-up included): blocked / total | {first['blocked_s']:.3f} s / {first['total_s']:.3f} s |",
        f"| host copy of every shard of the state (`np.array(shard, copy=True)`) | {result['host_copy_s']:.3f} s |",
        f"| restore (`restore_or_init`: state + data iterator), bitwise equal | {result['restore_s']:.3f} s, "
        f"{result['restore_bitwise_equal']} |",
        f"| a save whose arrays were donated to the next step mid-save, bitwise equal | "
        f"{result['saved_then_donated_mid_save_bitwise_equal']} |",
        "",
        "Reading it: `blocked` is what the training loop pays per save: Orbax's start-of-save barrier, "
        "creating the step's temporary directories, handing the arrays to the background writer and "
        "writing the Grain iterator state (a small JSON, written synchronously so that it matches the "
        "train state exactly). On CPU the arrays are not copied in that window (the host copy row shows "
        "what a full copy would cost); the last row checks that donating them to the next step while "
        "the write runs does not change what is saved. `total` runs until the step directory is "
        "renamed into place, with one donated update running alongside. The first save also sets up "
        "Orbax's thread pools and TensorStore context. On TPU the blocking window also holds the "
        "device-to-host copy of this host's shards, so the fraction there is set by HBM-to-host "
        "bandwidth against storage bandwidth.",
        "",
        "Produced by:",
        "",
        "```",
        result["command"],
        "```",
        "",
    ]
    bc.write_markdown(os.path.join(out_dir, "bench_checkpoint.md"), "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    cli.run(main)
