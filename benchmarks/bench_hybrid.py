"""What a hybrid model's local layers save on CPU: train steps and one layer's attention.

  .venv/bin/python benchmarks/bench_hybrid.py            # S = 8,192 over sp = 4, window 256
  .venv/bin/python benchmarks/bench_hybrid.py --quick    # S = 2,048, window 128, 2 timed repeats

Two models of the `tiny_hybrid` preset's shape (6 layers): the hybrid, five sliding-window layers
(attention.cp=halo) to one global (the ring), and the same model with every layer global (no
pattern). And one layer's attention, forward + backward, a window layer's (halo) against a global
layer's (ring), on the same mesh (dp 1, fsdp 2, sp 4 over 8 CPU devices). The rows hold long
documents (random lengths up to 2 S: one or two per row), the regime a hybrid is for; with short
packed documents a global layer is already local and the two cost about the same.
Each measurement: one compile + warm-up, then the hybrid and the uniform timed in turn (A, B, A,
B, ...: the machine's load moves both alike), the median of each; the ratios come from one run.
Writes docs/bench_hybrid.json and its section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from bench_train import synthetic_rows  # noqa: E402
from longctx.model import attention as attention_lib  # noqa: E402
from longctx.model import layer_types  # noqa: E402
from longctx.ops import context_parallel  # noqa: E402
from longctx.ops.masks import segment_positions  # noqa: E402
from longctx.parallel import layout as layout_lib  # noqa: E402
from longctx.parallel import mesh as mesh_lib  # noqa: E402
from longctx.train import state as train_state  # noqa: E402
from longctx.train import steps as train_steps  # noqa: E402

SECTION = "bench_hybrid"


def model_config(args, hybrid: bool):
    c = bc.base_config("tiny_hybrid")
    c.unlock()
    c.data.update(seq_len=args.seq_len, global_batch_size=2)
    c.attention.layer_types.local.sliding_window = args.window
    if not hybrid:
        c.attention.pattern = ""
    shard = args.seq_len // c.mesh.sp
    c.train.update(loss_chunk_size=min(c.train.loss_chunk_size, shard))
    return c


def _timed(fn, repeats: int):
    """Seconds of `repeats` calls of fn (each waited for)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - start)
    return out


def step_runner(args, hybrid: bool):
    """A function running one train step of the model, compiled and warmed up; its layout."""
    c = model_config(args, hybrid)
    mesh = mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:8])
    layout = train_state.resolve_layout(c, c.mesh.sp)
    rows = synthetic_rows(2, args.seq_len, c.model.vocab_size, mean_doc=args.seq_len)
    perm = layout_lib.permutation(layout, args.seq_len, c.mesh.sp)
    with jax.set_mesh(mesh):
        setup = train_state.make_setup(c, mesh, layout)
        state = [setup.init(jax.random.PRNGKey(0))]
        step, _ = train_steps.jit_steps(c, setup)
        batch = {k: jax.device_put(v[:, perm], setup.batch_sharding) for k, v in rows.items()}

    def run():
        with jax.set_mesh(mesh):
            state[0], metrics = step(state[0], batch)
        return state[0], metrics

    start = time.perf_counter()
    jax.block_until_ready(run())
    return run, layout, time.perf_counter() - start


def attention_runner(args, hybrid: bool, layout: str):
    """One layer's attention fwd + bwd (the window type's on the halo, or a global layer's on the
    ring), jitted over the model's mesh, warmed up."""
    c = model_config(args, True)
    layer_type = layer_types.resolve(c, "local" if hybrid else "global")
    mesh = mesh_lib.make_mesh(c.mesh, devices=jax.devices()[:8])
    keywords = dict(**attention_lib.mask_kwargs(layer_type.attention),
                    **attention_lib.strategy_kwargs(layer_type.attention), axis_name=mesh_lib.SP,
                    layout=layout, impl=c.attention.impl, block_sizes=c.attention.block_size)
    rng = np.random.default_rng(0)
    m = c.model
    shape = (2, args.seq_len)
    q = jnp.asarray(rng.standard_normal((*shape, m.num_heads, m.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((*shape, m.num_kv_heads, m.head_dim)), jnp.float32)
            for _ in range(2))
    seg = synthetic_rows(2, args.seq_len, m.vocab_size, mean_doc=args.seq_len)["segment_ids"]
    pos = segment_positions(seg)
    perm = layout_lib.permutation(layout, args.seq_len, c.mesh.sp)
    data = P(("dp", "fsdp"), "sp")

    def attend(q, k, v, seg, pos):
        return jax.shard_map(lambda q, k, v, s, p: context_parallel.context_parallel_attention(
            q, k, v, s, s, positions=p, **keywords), mesh=mesh, in_specs=(data,) * 5, out_specs=data)(
            q, k, v, seg, pos)

    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, seg, pos: attend(q, k, v, seg, pos).sum(), argnums=(0, 1, 2)))
    inputs = [x[:, perm] for x in (q, k, v, jnp.asarray(seg), jnp.asarray(pos))]

    def run():
        return fwd_bwd(*inputs)

    jax.block_until_ready(run())
    return run


def alternate(runners: dict, repeats: int) -> dict:
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            times[name] += _timed(run, 1)
    return {name: float(np.median(t)) for name, t in times.items()}


def measure(args) -> dict:
    hybrid_step, layout, hybrid_compile = step_runner(args, True)
    uniform_step, uniform_layout, uniform_compile = step_runner(args, False)
    steps = alternate({"hybrid": hybrid_step, "global": uniform_step}, args.repeats)
    attention = alternate({"window": attention_runner(args, True, layout),
                           "global": attention_runner(args, False, layout)}, args.repeats)
    return {
        "settings": {"seq_len": args.seq_len, "sp": 4, "window": args.window, "repeats": args.repeats,
                     "layers": 6, "pattern": "5 local : 1 global", "hybrid layout": layout,
                     "uniform layout": uniform_layout},
        "step_s": steps, "step_ratio": steps["hybrid"] / steps["global"],
        "first_step_s": {"hybrid": hybrid_compile, "global": uniform_compile},
        "attention_fwd_bwd_s": attention, "attention_ratio": attention["window"] / attention["global"],
        "machine": bc.machine(), "command": bc.command_line(),
    }


def markdown(result: dict) -> str:
    s = result["settings"]
    rows = [["train step (6 layers)", f"{result['step_s']['hybrid']:.3f}", f"{result['step_s']['global']:.3f}",
             f"{result['step_ratio']:.2f}"],
            ["one layer's attention, fwd + bwd", f"{result['attention_fwd_bwd_s']['window']:.3f}",
             f"{result['attention_fwd_bwd_s']['global']:.3f}", f"{result['attention_ratio']:.2f}"]]
    return ("## Hybrid attention on CPU (`bench_hybrid.py`)\n\n"
            f"Measured by `{result['command']}` on {result['machine']['cpu_count']} cores of "
            f"{result['machine']['cpu_model']}, shared with other work (the absolute times are "
            f"inflated; the ratios are of runs taken in turn): tiny_hybrid's shape at S = "
            f"{s['seq_len']:,} over sp = 4 (mesh 1 x 2 x 4), window {s['window']} on the halo, "
            f"long documents (one or two per row); layouts {s['hybrid layout']} (hybrid) and "
            f"{s['uniform layout']} (every layer global); the median of {s['repeats']} repeats, "
            "taken in turn.\n\n"
            + bc.table(["", "hybrid / window layer s", "all global / global layer s", "ratio"], rows)
            + "\n")


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=cli.int_at_least(1024), default=8192)
    p.add_argument("--window", type=cli.int_at_least(1), default=256)
    p.add_argument("--repeats", type=cli.int_at_least(1), default=5)
    p.add_argument("--quick", action="store_true", help="S = 2,048, window 128, 2 repeats")
    bc.add_output_arguments(p, SECTION, render_only_help="rewrite the section from --json")
    args = p.parse_args()
    if args.render_only:
        cli.validated(f"--render-only from {args.json}")
        with open(args.json) as f:
            result = json.load(f)
        bc.write_section(SECTION, markdown(result), args.md)
        return 0
    if args.quick:
        args.seq_len, args.window, args.repeats = 2048, 128, 2
    if cli.validate_only():
        cli.validated(f"bench_hybrid at S={args.seq_len}, window {args.window} is ready")
    result = measure(args)
    bc.write_json(args.json, result)
    bc.write_section(SECTION, markdown(result), args.md)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    cli.run(main)
