"""Run a mask-type ablation grid and compare the variants.

  python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks
  python scripts/ablate.py --grid=configs/ablations/masks.py --workdir=runs/ablate_masks --dry-run

Writes DIR/ablation.md (final train/val loss, tokens/s, ring schedule efficiency, steps),
DIR/ablation.png (loss curves) and DIR/position_loss.png (validation loss by token position).
Re-running skips finished variants and resumes unfinished ones from their checkpoints.
"""

import argparse
import shlex
import sys

from longctx import cli

cli.start(cpu_devices=None)  # the training runs it starts set up their own devices

from longctx import ablation  # noqa: E402
from longctx import workdir as workdir_lib  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", required=True, help="grid file, e.g. configs/ablations/masks.py")
    parser.add_argument("--workdir", required=True, help="one sub-directory per variant goes here")
    parser.add_argument("--dry-run", action="store_true", help="print the commands (for a cluster) and stop")
    args = parser.parse_args()
    workdir_lib.check_named(args.workdir)
    variants = ablation.run_grid(args.grid, args.workdir, dry_run=args.dry_run)
    if args.dry_run:
        return 0
    rows = ablation.summarize(variants, args.workdir)
    paths = ablation.write_report(rows, args.workdir, shlex.join(["python", *sys.argv]))
    print(ablation.markdown_table(rows))
    print("ablate: wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    cli.run(main)
