"""Tokens/s of the demo model's train step across (dp, fsdp, sp) mesh shapes on CPU devices.

  .venv/bin/python benchmarks/bench_train.py                 # 8 virtual CPU devices, 5 mesh shapes
  .venv/bin/python benchmarks/bench_train.py --quick         # 2 shapes, 2 timed steps

The `tiny` preset (configs/base.py) with a global batch that every shape can split (8 rows of
1,024 tokens); synthetic packed documents (random boundaries), already in the ring layout.
Each shape: one compile+warm-up step, then the median of --steps timed steps
(block_until_ready on the metrics and state). Writes docs/bench_train.json and its section of
docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from longctx.parallel import layout as layout_lib  # noqa: E402
from longctx.parallel import mesh as mesh_lib  # noqa: E402
from longctx.train import state as train_state  # noqa: E402
from longctx.train import steps as train_steps  # noqa: E402

SHAPES = [(1, 1, 8), (1, 2, 4), (2, 2, 2), (1, 8, 1), (8, 1, 1)]


def synthetic_rows(batch, seq_len, vocab, seed=0, mean_doc=256):
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((batch, seq_len), np.int32) for k in train_steps.BATCH_KEYS}
    for b in range(batch):
        toks = rng.integers(0, vocab, seq_len + 1)
        t, seg = 0, 1
        while t < seq_len:
            n = min(int(rng.integers(1, 2 * mean_doc)), seq_len - t)
            out["tokens"][b, t:t + n] = toks[t:t + n]
            out["segment_ids"][b, t:t + n] = seg
            out["positions"][b, t:t + n] = np.arange(n)
            out["targets"][b, t:t + n] = toks[t + 1:t + n + 1]
            out["loss_mask"][b, t:t + n - 1] = 1
            t, seg = t + n, seg + 1
    return out


def config_for(shape, args):
    c = bc.base_config("tiny")
    c.unlock()
    dp, fsdp, sp = shape
    c.mesh.update(dp=dp, fsdp=fsdp, sp=sp)
    c.data.update(seq_len=args.seq_len, global_batch_size=args.batch)
    shard = args.seq_len // sp
    c.attention.update(block_size=min(c.attention.block_size, shard))
    c.train.update(loss_chunk_size=min(c.train.loss_chunk_size, shard))
    return c


def bench_shape(shape, args):
    c = config_for(shape, args)
    devices = jax.devices()[:int(np.prod(shape))]
    mesh = mesh_lib.make_mesh(c.mesh, devices=devices)
    sp = shape[2]
    layout = train_state.resolve_layout(c, sp)
    perm = layout_lib.permutation(layout, args.seq_len, sp)
    rows = synthetic_rows(args.batch, args.seq_len, c.model.vocab_size)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(c, mesh, layout)
        state = setup.init(jax.random.PRNGKey(0))
        step, _ = train_steps.jit_steps(c, setup)
        batch = {k: jax.device_put(v[:, perm], setup.batch_sharding) for k, v in rows.items()}
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        first = time.perf_counter() - start
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
    med = float(np.median(times))
    tokens = args.batch * args.seq_len
    row = {"mesh": dict(zip(("dp", "fsdp", "sp"), shape)), "layout": layout,
           "attention": c.attention.impl, "compile_and_first_step_s": first, "step_times_s": times,
           "median_step_s": med, "tokens_per_s": tokens / med, "loss": float(metrics["loss"])}
    print(f"  dp={shape[0]} fsdp={shape[1]} sp={shape[2]}: {row['tokens_per_s']:9.0f} tokens/s "
          f"(step {med * 1e3:7.1f} ms, first {first:5.1f}s)", flush=True)
    return row


def markdown(result) -> str:
    m = result["machine"]
    out = ["## Train step throughput by mesh shape (`bench_train.py`)\n",
           f"Command: `{result['command']}`  ",
           f"Machine: {m['cpu_count']} CPU cores shared by {m['devices']} virtual devices, jax "
           f"{m['jax']}. Model: the `tiny` preset ({result['model']}); global batch "
           f"{result['batch']} x {result['seq_len']} tokens; median of {result['steps']} steps "
           "after a compile+warm-up step.\n"]
    rows = [[r["mesh"]["dp"], r["mesh"]["fsdp"], r["mesh"]["sp"], r["layout"],
             f"{r['median_step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:.0f}",
             f"{r['compile_and_first_step_s']:.1f}"] for r in result["rows"]]
    out.append(bc.table(["dp", "fsdp", "sp", "layout", "step ms", "tokens/s",
                         "compile + first step s"], rows))
    out.append("\nOn one CPU host the virtual devices share the same cores, so this measures the "
               "overhead of each parallelism (collectives, ring steps, smaller per-device matmuls), "
               "not a speed-up from more devices.")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    bc.add_output_arguments(ap, "bench_train")
    args = ap.parse_args()
    cli.validated("the flags are fine")
    shapes = SHAPES
    if args.quick:
        shapes, args.steps, args.seq_len, args.batch = [(1, 2, 4)], 1, 256, 2
    n = jax.device_count()
    shapes = [s for s in shapes if int(np.prod(s)) <= n]
    c = bc.base_config("tiny")
    model = (f"{c.model.num_layers} layers, d_model {c.model.d_model}, {c.model.num_heads} heads, "
             f"{c.model.dtype}, attention {c.attention.impl}")
    result = {"command": bc.command_line(), "machine": bc.machine(), "model": model,
              "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "rows": []}
    for shape in shapes:
        result["rows"].append(bench_shape(shape, args))
        bc.write_json(args.json, result)
    bc.write_section("bench_train", markdown(result), args.md)


if __name__ == "__main__":
    cli.run(main)
