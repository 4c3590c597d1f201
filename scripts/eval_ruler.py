"""RULER's synthetic tasks on a trained or converted model: ruler.json + ruler.png (task x length).

  .venv/bin/python scripts/eval_ruler.py --workdir=runs/demo
  .venv/bin/python scripts/eval_ruler.py --workdir=runs/llama3_8b_extend --lengths=16384,32768,65536,131072 \\
      --tasks=niah_single_1,niah_multikey_1,vt,cwe --samples=4 --out=runs/llama3_8b_extend/ruler_final

  # a converted Hugging Face model: its own tokenizer, haystacks from a prepared dataset
  python scripts/eval_ruler.py --checkpoint=runs/llama3_8b_hf --tokenizer=hf:Meta-Llama-3-8B \\
      --data=data/llama3_long --mesh=1,1,-1

Generates RULER's niah (single, multi-key, multi-value, multi-query), variable tracking, common-
and frequent-word tasks (longctx/evals/ruler_tasks.py: RULER's templates; haystacks of noise
sentences, the validation documents of a prepared dataset, or essay text from them) at each
length and needle depth, seeded, and scores each answer as RULER does (the fraction of expected
strings found) on the greedy answer, found by teacher forcing in one forward pass per row on the
run's mesh and layout (longctx/evals/ruler.py). A task that does not fit at a length is reported
as not run; where none fits at any length the command refuses in one line and writes nothing.
--workdir (a training run) or --checkpoint (a scripts/convert_hf.py output, or any directory of
checkpoints) names the model; its tokenizer and haystack data are found as
scripts/eval_needle.py finds them (--tokenizer, --data). Writes ruler.json (score per task and
length, per depth, and the tokenizer, haystacks and seed used) and the heatmap ruler.png to --out
(default: the model's directory) and prints the score per task.
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

import argparse  # noqa: E402


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, for the model's sources
import eval_needle  # noqa: E402  (how a model's tokenizer, data and mesh are found: one copy)

from longctx.errors import ConfigError  # noqa: E402
from longctx.evals import needle  # noqa: E402
from longctx.evals import ruler  # noqa: E402
from longctx.evals import ruler_tasks  # noqa: E402
from longctx.interop import params_io  # noqa: E402
from longctx.train import workdir as workdir_lib  # noqa: E402


def _tasks(text: str) -> list[str]:
    """--tasks: names from ruler_tasks.TASKS, comma-separated."""
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in ruler_tasks.TASKS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{(unknown or [text])[0]!r} is not a RULER task; the tasks are "
                                         f"{', '.join(ruler_tasks.TASKS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The flags, each number with its range (a value outside it is one line naming the flag)."""
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workdir", help="training workdir (or --checkpoint)")
    p.add_argument("--checkpoint", help="directory of checkpoints: a converted model (or --workdir)")
    p.add_argument("--out", help="where ruler.json and ruler.png go (default: the model's directory)")
    p.add_argument("--tasks", type=_tasks, default=list(ruler_tasks.TASKS),
                   help=f"comma-separated tasks (default: all: {','.join(ruler_tasks.TASKS)})")
    p.add_argument("--lengths", type=eval_needle._lengths, help="lengths in tokens (default: seq_len/8 .. seq_len)")
    p.add_argument("--depths", type=cli.int_at_least(1), default=5,
                   help="number of needle depths, evenly from 0%% to 100%% (niah and vt)")
    p.add_argument("--samples", type=cli.int_at_least(1), default=2,
                   help="samples per (task, length, depth); cwe and fwe take as many per length")
    p.add_argument("--seed", type=cli.int_at_least(0), default=0, help="sample seed (0 or more)")
    eval_needle.add_model_flags(p, haystacks="makes the documents and essay haystacks",
                                tokenizer_default="as scripts/eval_needle.py finds it")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax's notes about read-only checkpoint directories
    if bool(args.workdir) == bool(args.checkpoint):
        raise ConfigError("name the model with one of --workdir=RUN or --checkpoint=DIR.")
    flag = "--workdir" if args.workdir else "--checkpoint"
    args.workdir = args.workdir or args.checkpoint  # (eval_needle's helpers read --workdir's value)
    workdir_lib.check_named(args.workdir)  # "" would read the current directory

    config, directory, step = params_io.read_config(args.workdir, flag)
    overrides = eval_needle._mesh_overrides(args, config)
    if args.seq_len:
        overrides["data.seq_len"] = args.seq_len
    if args.impl:
        overrides["attention.impl"] = args.impl
    seq_len = args.seq_len or config.data.seq_len
    if args.lengths and max(args.lengths) > seq_len:
        raise ConfigError(f"--lengths={max(args.lengths)} is longer than the {seq_len}-token sequences "
                          f"the model runs at; pass --seq-len={max(args.lengths)} as well.")
    cli.validated(f"{flag} {args.workdir} holds a checkpoint (step {step})")
    runner, tokenizer, documents, source = eval_needle.model_and_documents(args, config, directory, step,
                                                                           overrides, flag)
    depths = eval_needle.evenly_spread_depths(args.depths)
    lengths = args.lengths or needle.default_lengths(runner.config.data.seq_len, shortest=256)
    result = ruler.evaluate(runner, tokenizer, documents, tasks=args.tasks, lengths=lengths, depths=depths,
                            samples=args.samples, seed=args.seed, refuse_if_none_fit=True)
    result.update(step=step, model=args.workdir, data_dir=source.data_dir, data_tokenizer=source.data_tokenizer,
                  tokenizer=source.tokenizer, tokenizer_from=source.tokenizer_from,
                  haystack_retokenized=source.retokenized)
    json_path, png_path = ruler.write_results(result, args.out or args.workdir, title=f"RULER, step {step}")
    for task, row in zip(result["tasks"], result["score"]):
        cells = " ".join("  -  " if v is None else f"{v:.2f}" for v in row)
        print(f"eval_ruler: {task:<16} {cells}   (haystack {result['haystack'][task] or '-'})")
    print(f"eval_ruler: lengths {', '.join(f'{n:,}' for n in result['lengths'])}; tokenizer {tokenizer.name}, "
          f"seed {args.seed}; not run (too long for the length): {len(result['not_run'])} cells")
    mean = result["mean_score"]
    print(f"eval_ruler: mean score {'-' if mean is None else f'{mean:.3f}'}; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    cli.run(main)
