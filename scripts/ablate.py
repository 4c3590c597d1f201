"""Run a mask-type ablation grid and compare the variants.

  .venv/bin/python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks
  .venv/bin/python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks --dry-run

  .venv/bin/python scripts/ablate.py --grid=configs/ablations/hybrid.py --workdir=runs/ablate_hybrid --seeds=3

Writes DIR/ablation.md (final train/val loss, tokens/s, ring schedule efficiency, steps; with
--seeds N, their mean and standard deviation over N seeds and which variants lie within each
other's spread; the validation loss past each variant's shortest window; K/V bytes per step),
DIR/ablation.png (loss curves) and DIR/position_loss.png (validation loss by token position).
Re-running skips finished runs and resumes unfinished ones from their checkpoints. Every variant's
config is checked (as --validate_only checks it) before the first run starts: a bad one is one line,
exit status 2, and nothing runs.
"""

import argparse
import os
import shlex
import subprocess
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start(cpu_devices=None)  # the training runs it starts set up their own devices

from longctx.evals import ablation  # noqa: E402
from longctx.parallel import devices  # noqa: E402
from longctx.train import workdir as workdir_lib  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def validate_grid(grid: str) -> str:
    """--validate_only: every variant's config checked as its training run would check it (on the
    devices the runs would see; attention.cp=auto and block_size=auto resolved by the planner as
    scripts/train.py resolves them), none started."""
    devices.configure_cpu_devices()  # what each run's cli.start() sets up
    # lazily, as every jax import here: the parent process that starts the runs must not start
    # jax (on a TPU host it would hold the chips its runs need)
    import jax

    from longctx import config as config_lib
    from longctx.plan import auto

    _, variants = ablation.load_grid(grid)
    for variant in variants:
        try:
            config = auto.resolve(variant.config, jax.devices()).config
            config_lib.validate(config, num_devices=jax.device_count())
        except ConfigError as e:
            raise ConfigError(f"grid variant {variant.name!r}: {e}") from None
    return f"the {len(variants)} variants of {grid} are fine"


def validate_in_a_child(args) -> int:
    """`validate_grid` before the first run trains (a bad last variant would otherwise fail after
    the others' hours), in a process of its own for the reason above; its exit status, and its one
    line where it refused."""
    check = subprocess.run([sys.executable, os.path.abspath(__file__), f"--grid={args.grid}",
                            f"--workdir={args.workdir}", "--validate_only"], capture_output=True, text=True)
    if check.returncode:
        sys.stderr.write(check.stderr)
    return check.returncode


def kv_bytes_per_step(config, layout: str, mesh: dict) -> int | None:
    """The K/V bytes (with their segment ids, and dK/dV back in the backward) one device sends in
    one training step, summed over the layers: longctx.plan.collectives' closed form for each
    layer type's strategy and mask, on the run's layout and mesh (a bound for the ring with
    documents, which may stop early). None for a strategy that formula does not price."""
    # lazily: jax and the ops load only once the runs are done
    from longctx.plan import collectives

    data_ways = mesh["dp"] * mesh["fsdp"] * mesh.get("dcn_dp", 1) * mesh.get("dcn_fsdp", 1)
    return collectives.step_bytes(config, sp=mesh["sp"], rows=config.data.global_batch_size // data_ways,
                                  layout=layout)


def price_kv(rows: list[dict], variants) -> None:
    """Adds each row's K/V bytes per step (kv_bytes_per_step on its first run's layout and mesh)."""
    for row, variant in zip(rows, variants):
        run = next((r for r in row["runs"] if r["layout"] and r["mesh"]), None)
        row["kv_bytes"] = kv_bytes_per_step(variant.config, run["layout"], run["mesh"]) if run else None


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="grid file, e.g. configs/ablations/masks.py")
    parser.add_argument("--workdir", required=True, help="one sub-directory per variant goes here")
    parser.add_argument("--seeds", type=cli.int_at_least(1), default=1,
                        help="runs per variant (config seed, seed + 1, ...; each in DIR/<variant>/seed_<s>); "
                             "the table gives mean and standard deviation over them")
    parser.add_argument("--dry-run", action="store_true", help="print the commands (for a cluster) and stop")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    workdir_lib.check_named(args.workdir)
    if cli.validate_only():
        cli.validated(validate_grid(args.grid))
    if not args.dry_run:
        status = validate_in_a_child(args)
        if status:
            return status
    variants = ablation.run_grid(args.grid, args.workdir, seeds=args.seeds, dry_run=args.dry_run)
    if args.dry_run:
        return 0
    rows = ablation.summarize(variants, args.workdir, seeds=args.seeds)
    price_kv(rows, variants)
    paths = ablation.write_report(rows, args.workdir, shlex.join([".venv/bin/python", *sys.argv]))
    print(ablation.markdown_table(rows))
    print("ablate: wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    cli.run(main)
