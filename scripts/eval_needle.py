"""Passkey retrieval (needle in a haystack) of a trained or converted model: needle.json + needle.png.

  python scripts/eval_needle.py --workdir=runs/demo
  python scripts/eval_needle.py --workdir=runs/llama3_8b_extend --lengths=16384,32768,65536,131072 \\
      --samples=8 --out=runs/llama3_8b_extend/needle_final

Builds haystacks from the validation split of the run's dataset (data.path in its saved config,
or the embedded corpus), with a 5-digit passkey sentence at depths 0-100% of the filler, for
lengths up to data.seq_len (--seq-len evaluates past the training length), and runs them through
the newest checkpoint under --workdir (a training workdir or a scripts/convert_hf.py output) on
the run's mesh and layout, exactly as in training. A passkey counts when greedy decoding
reproduces all of its tokens. Writes needle.json (accuracy per length x depth) and the heatmap
needle.png to --out (default: the workdir) and prints the accuracy per length.
"""

from longctx import cli

cli.start()  # before jax is imported

import argparse  # noqa: E402

import numpy as np  # noqa: E402

from longctx import data as data_lib  # noqa: E402
from longctx import inference  # noqa: E402
from longctx import needle  # noqa: E402
from longctx import params_io  # noqa: E402
from longctx import workdir as workdir_lib  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workdir", required=True, help="training workdir or converted checkpoint directory")
    p.add_argument("--out", help="where needle.json and needle.png go (default: --workdir)")
    p.add_argument("--lengths", type=_ints, help="haystack lengths in tokens (default: seq_len/8 .. seq_len)")
    p.add_argument("--depths", type=int, default=len(needle.DEFAULT_DEPTHS),
                   help="number of needle depths, evenly from 0%% to 100%%")
    p.add_argument("--samples", type=int, default=4, help="passkeys per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, help="run at this data.seq_len instead of the run's")
    p.add_argument("--mesh", help="DP,FSDP,SP instead of the run's mesh")
    p.add_argument("--impl", choices=("splash", "xla"), help="attention impl instead of the run's")
    args = p.parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax's notes about read-only checkpoint directories
    workdir_lib.check_named(args.workdir)  # "" would read the current directory
    if args.samples < 1 or args.depths < 1:
        raise ConfigError("--samples and --depths must be at least 1.")

    config, _, step = params_io.read_config(args.workdir)
    overrides = {}
    if args.seq_len:
        overrides["data.seq_len"] = args.seq_len
    if args.mesh:
        try:
            dp, fsdp, sp = (int(x) for x in args.mesh.split(","))
        except ValueError:
            raise ConfigError(f"--mesh={args.mesh!r} must be three integers DP,FSDP,SP.") from None
        overrides.update({"mesh.dp": dp, "mesh.fsdp": fsdp, "mesh.sp": sp})
    if args.impl:
        overrides["attention.impl"] = args.impl
    runner = inference.runner_from_checkpoint(args.workdir, overrides)
    data_dir = data_lib.resolve_dataset(runner.config)
    meta = data_lib.load_metadata(data_dir)
    if meta["vocab_size"] > runner.config.model.vocab_size:
        raise ConfigError(f"the dataset's vocabulary ({meta['vocab_size']} in {data_dir}) is larger than "
                          f"model.vocab_size={runner.config.model.vocab_size}.")
    tokenizer, documents = needle.validation_documents(runner.config, data_dir)
    depths = tuple(float(d) for d in np.round(np.linspace(0.0, 1.0, args.depths), 3)) if args.depths > 1 else (0.5,)
    try:
        result = needle.evaluate(runner, tokenizer, documents, lengths=args.lengths, depths=depths,
                                 samples=args.samples, seed=args.seed)
    except ValueError as e:  # a length the haystack cannot hold / longer than seq_len
        raise ConfigError(str(e)) from None
    result.update(step=step, workdir=args.workdir, data_dir=data_dir, tokenizer=meta["tokenizer"])
    json_path, png_path = needle.write_results(result, args.out or args.workdir,
                                               title=f"passkey retrieval, step {step}")
    for length, row in zip(result["lengths"], result["accuracy"]):
        print(f"eval_needle: length {length:>8,}: accuracy {np.mean(row):.2f} "
              f"({' '.join(f'{a:.2f}' for a in row)} over depths {depths[0]:.0%}..{depths[-1]:.0%})")
    print(f"eval_needle: mean accuracy {result['mean_accuracy']:.3f} over {len(result['lengths']) * len(depths) * args.samples} "
          f"haystacks; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    cli.run(main)
