"""Compile time of a hybrid model against a uniform model, for a TPU.

  .venv/bin/python benchmarks/bench_hybrid_compile.py              # 8B shape, v5p:2x2x2, 2 repeats

The llama3_8b_128k preset's 32 layers at --seq-len tokens over sp = 8, compiled ahead of time for
--topology (lowering + XLA + Mosaic; nothing runs): the uniform model, and the same with a period of
6 layer types (five sliding-window layers of 1,024 on the halo, one global on the ring: 5 periods
and a remainder of 2). The decoder scans one layer body over the depth for both (the type is data
beside each layer's parameters; only the attention, and RoPE's theta, branch on it), so the
hybrid's program holds the MLP once, the q/k/v projections once per theta and the halo and the
ring once each. Compiled in turn (uniform, hybrid, uniform, ...), the median of each, in wall-clock seconds and in the
process's CPU seconds (all its threads: on a shared machine the steadier measure of the
compiler's work); the ratios come from one run. Writes docs/bench_hybrid_compile.json and its section of docs/benchmarks.md.
"""
from longctx import cli

cli.start(cpu_devices=8)  # before jax is imported

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from longctx.plan import aot  # noqa: E402

SECTION = "bench_hybrid_compile"
PATTERN = "local,local,local,local,local,global"


def config(args, hybrid: bool):
    c = bc.base_config("llama3_8b_128k")
    c.unlock()
    c.mesh.update(dp=1, fsdp=1, sp=8)
    c.data.update(seq_len=args.seq_len, global_batch_size=1)
    if hybrid:
        c.attention.pattern = PATTERN
        c.attention.layer_types = ml_collections.ConfigDict(
            {"local": dict(sliding_window=1024, rope_theta=10_000.0, cp="halo"), "global": {}})
    return c


def measure(args) -> dict:
    seconds, cpu_seconds = {"uniform": [], "hybrid": []}, {"uniform": [], "hybrid": []}
    memory = {}
    for _ in range(args.repeats):
        for name in seconds:
            result = aot.compile_train_step(config(args, name == "hybrid"), args.topology,
                                            say=lambda line: print(line, flush=True))
            seconds[name].append(result.compile_seconds)
            cpu_seconds[name].append(result.compile_cpu_seconds)
            memory[name] = result.total_bytes / aot.GIB
            print(f"{name}: {result.compile_seconds:.1f} s ({result.compile_cpu_seconds:.1f} CPU s), "
                  f"{memory[name]:.1f} GiB per chip", flush=True)
    median = {name: float(np.median(s)) for name, s in seconds.items()}
    median_cpu = {name: float(np.median(s)) for name, s in cpu_seconds.items()}
    return {"settings": {"preset": "llama3_8b_128k", "layers": 32, "pattern": PATTERN,
                         "topology": args.topology, "seq_len": args.seq_len, "sp": 8,
                         "repeats": args.repeats},
            "compile_s": seconds, "median_s": median, "ratio": median["hybrid"] / median["uniform"],
            "compile_cpu_s": cpu_seconds, "median_cpu_s": median_cpu,
            "cpu_ratio": median_cpu["hybrid"] / median_cpu["uniform"],
            "gib_per_chip": memory, "machine": bc.machine()}


def markdown(result: dict) -> str:
    s, m, c = result["settings"], result["median_s"], result["median_cpu_s"]
    rows = [[name, ", ".join(f"{x:.1f}" for x in result["compile_s"][name]), f"{m[name]:.1f}",
             ", ".join(f"{x:.1f}" for x in result["compile_cpu_s"][name]), f"{c[name]:.1f}",
             f"{result['gib_per_chip'][name]:.1f}"] for name in ("uniform", "hybrid")]
    return ("## Hybrid attention: compile time (`bench_hybrid_compile.py`)\n\n"
            f"Measured by `{bc.command_line()}`: the {s['layers']}-layer 8B shape at "
            f"{s['seq_len']:,} tokens over sp = {s['sp']}, compiled for {s['topology']} (lowering and "
            f"compile of the whole train step), uniform and with the period `{s['pattern']}` "
            f"(window 1,024 on the halo), in turn. **Hybrid / uniform: {result['ratio']:.2f}x in "
            f"wall-clock time, {result['cpu_ratio']:.2f}x in CPU time.**\n\n"
            + bc.table(["model", "compile s (each)", "median s", "CPU s (each)", "median CPU s",
                        "GiB per chip"], rows) + "\n")


def main() -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5p:2x2x2")
    p.add_argument("--seq-len", type=cli.int_at_least(8192), default=32768)
    p.add_argument("--repeats", type=cli.int_at_least(1), default=2)
    bc.add_output_arguments(p, SECTION)
    args = p.parse_args()
    if cli.validate_only():
        aot.topology_devices(args.topology)
        cli.validated(f"bench_hybrid_compile for {args.topology} is ready")
    result = measure(args)
    bc.write_json(args.json, result)
    bc.write_section(SECTION, markdown(result), args.md)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    cli.run(main)
