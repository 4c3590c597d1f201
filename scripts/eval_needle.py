"""Passkey retrieval (needle in a haystack) of a trained or converted model: needle.json + needle.png.

  .venv/bin/python scripts/eval_needle.py --workdir=runs/demo
  .venv/bin/python scripts/eval_needle.py --workdir=runs/llama3_8b_extend --lengths=16384,32768,65536,131072 \\
      --samples=8 --out=runs/llama3_8b_extend/needle_final

  # a converted Hugging Face model: its own tokenizer, filler from a prepared dataset
  python scripts/eval_needle.py --workdir=runs/llama3_8b_hf --tokenizer=hf:Meta-Llama-3-8B \\
      --data=data/llama3_long --mesh=1,1,-1

Builds haystacks from the validation split of a prepared dataset (--data; default: the run's
data.path, else the embedded corpus), with a 5-digit passkey sentence at depths 0-100% of the
filler, for lengths up to the run's sequence length (--seq-len evaluates past it), and runs them
through the newest checkpoint under --workdir (a training workdir or a scripts/convert_hf.py
output) on the run's mesh and layout, exactly as in training. A passkey counts when greedy
decoding reproduces all of its tokens.

The text is tokenized with the model's tokenizer: --tokenizer, else the dataset's for a run
trained on one (data.path), else for a converted model the tokenizer.json in --workdir or in
the Hugging Face directory it was converted from, else the filler dataset's (bytes for the
embedded corpus, a run's default data).
Filler stored with another tokenizer is decoded and encoded again. Writes needle.json (accuracy
per length x depth, and the tokenizer and data used) and the heatmap needle.png to --out
(default: the workdir) and prints the accuracy per length.
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

import argparse  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402

from longctx import data as data_lib  # noqa: E402
from longctx.evals import inference  # noqa: E402
from longctx.evals import needle  # noqa: E402
from longctx.interop import params_io  # noqa: E402
from longctx.train import workdir as workdir_lib  # noqa: E402
from longctx.data import tokenizer as tokenizer_lib  # noqa: E402
from longctx.errors import ConfigError, MissingFileError  # noqa: E402


def _lengths(text: str) -> list[int]:
    """--lengths: token counts, each at least 1."""
    try:
        lengths = [int(x) for x in text.split(",") if x]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts, "
                                         "each at least 1")
    return lengths


def _saved_metadata(directory: str, step: int) -> dict:
    """The checkpoint's metadata item (a converted one names its Hugging Face source), or {}."""
    import orbax.checkpoint as ocp

    try:
        with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                                   item_handlers={"metadata": ocp.JsonCheckpointHandler()}) as manager:
            return dict(manager.restore(step, args=ocp.args.Composite(
                metadata=ocp.args.JsonRestore()))["metadata"] or {})
    except Exception:  # noqa: BLE001  (no metadata: nothing to learn from it)
        return {}


def _converted_tokenizer(workdir: str, directory: str, step: int) -> tuple[str | None, bool]:
    """(an hf: spec of the tokenizer.json beside a converted model, whether --workdir is one): in
    --workdir itself, else in the Hugging Face directory it was converted from."""
    saved = _saved_metadata(directory, step)
    converted = bool(saved.get("parameters_only")) or _is_converted(workdir)
    source = saved.get("source") if converted else None
    for where in (workdir, source):
        if where and os.path.isfile(os.path.join(where, tokenizer_lib.HF_TOKENIZER_FILE)):
            return "hf:" + os.path.abspath(where), converted
    return None, converted


def _is_converted(workdir: str) -> bool:
    return os.path.isfile(os.path.join(workdir, "hf_config.json"))


def _dataset(args, config) -> str:
    """The prepared dataset whose validation split is the filler."""
    if args.data:
        if not os.path.isdir(args.data):
            raise MissingFileError(f"--data={args.data} does not exist.")
        return args.data
    if config.data.path and not os.path.isdir(config.data.path):
        raise MissingFileError(f"--workdir={args.workdir} was trained on {config.data.path}, which does "
                               "not exist here; pass --data=DIR (a scripts/prepare_data.py output) for "
                               "the haystacks' text.")
    return data_lib.resolve_dataset(config)


def _model_tokenizer(args, config, directory: str, step: int, data_dir: str) -> tuple[str, str | None, str]:
    """(tokenizer spec, the directory its relative paths are in, where it came from): see the
    module docstring."""
    if args.tokenizer:
        return args.tokenizer, None, "--tokenizer"
    if config.data.path and os.path.isdir(config.data.path):  # the run's dataset: what it learned
        return (data_lib.load_metadata(config.data.path)["tokenizer"], config.data.path,
                f"the run's dataset {config.data.path}")
    spec, converted = _converted_tokenizer(args.workdir, directory, step)
    if spec:
        return spec, None, "the converted model's Hugging Face directory"
    if converted:
        raise ConfigError(f"--workdir={args.workdir} holds a converted Hugging Face model and no "
                          f"{tokenizer_lib.HF_TOKENIZER_FILE} was found beside it or in the directory "
                          "it was converted from; pass --tokenizer=hf:DIR (the model's tokenizer).")
    origin = f"--data={args.data}" if args.data else "the embedded corpus (the run's data)"
    return data_lib.load_metadata(data_dir)["tokenizer"], data_dir, origin


def _mesh_overrides(args, config) -> dict:
    """--mesh as overrides, and a batch that the mesh's dp x fsdp divides."""
    import jax

    from longctx.parallel import mesh as mesh_lib

    overrides = {}
    if args.mesh:
        try:
            dp, fsdp, sp = (int(x) for x in args.mesh.split(","))
        except ValueError:
            raise ConfigError(f"--mesh={args.mesh!r} must be three integers DP,FSDP,SP.") from None
        overrides.update({"mesh.dp": dp, "mesh.fsdp": fsdp, "mesh.sp": sp})
    mesh = {**config.mesh.to_dict(), **{k.split(".")[1]: v for k, v in overrides.items()}}
    try:
        sizes = mesh_lib.resolve_mesh_shape(mesh, jax.device_count())
    except ValueError as e:
        flag = f"--mesh={args.mesh}" if args.mesh else f"the mesh of --workdir={args.workdir}"
        raise ConfigError(f"{flag}: {e}; pass --mesh=DP,FSDP,SP for these "
                          f"{jax.device_count()} devices.") from None
    ways = sizes["dp"] * sizes["fsdp"]
    overrides["data.global_batch_size"] = -(-config.data.global_batch_size // ways) * ways
    return overrides


class DocumentSource(NamedTuple):
    """Where an evaluation's model tokenizer and haystack documents came from (for its result file)."""
    data_dir: str
    data_tokenizer: str  # the dataset's tokenizer
    tokenizer: str  # the model's tokenizer spec
    tokenizer_from: str  # how that spec was found
    retokenized: bool  # the documents went through text into the model's ids


def model_and_documents(args, config, directory: str, step: int, overrides: dict, flag: str = "--workdir"):
    """(runner, the model's tokenizer, validation documents in its ids, DocumentSource) for the
    model `args.workdir` names (`flag`: the flag that named it), as --data and --tokenizer say."""
    data_dir = _dataset(args, config)
    meta = data_lib.load_metadata(data_dir)
    spec, spec_dir, origin = _model_tokenizer(args, config, directory, step, data_dir)
    tokenizer = tokenizer_lib.load_tokenizer(spec, spec_dir)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer.name} ({origin}) has {tokenizer.vocab_size} ids, more "
                          f"than the {config.model.vocab_size} of the model in {flag}={args.workdir}; "
                          "pass --tokenizer=SPEC, the tokenizer the model was trained with.")
    runner = inference.runner_from_checkpoint(args.workdir, overrides)
    data_tokenizer, documents = needle.validation_documents(runner.config, data_dir)
    # The dataset's ids are the model's when they name the same tokenizer file (or both bytes).
    retokenized = not (spec == meta["tokenizer"] and (spec == "byte" or spec_dir is not None and
                                                      os.path.realpath(spec_dir) == os.path.realpath(data_dir)))
    if retokenized:  # the dataset's ids are another tokenizer's: through text into the model's
        documents = needle.retokenized(documents, data_tokenizer, tokenizer)
    return runner, tokenizer, documents, DocumentSource(data_dir, data_tokenizer.name, spec, origin, retokenized)


def evenly_spread_depths(count: int) -> tuple[float, ...]:
    """--depths: `count` depths evenly from 0 to 1 (one: the middle)."""
    return tuple(float(d) for d in np.round(np.linspace(0.0, 1.0, count), 3)) if count > 1 else (0.5,)


def build_parser() -> argparse.ArgumentParser:
    """The flags, each number with its range (a value outside it is one line naming the flag)."""
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workdir", required=True, help="training workdir or converted checkpoint directory")
    p.add_argument("--out", help="where needle.json and needle.png go (default: --workdir)")
    p.add_argument("--lengths", type=_lengths, help="haystack lengths in tokens (default: seq_len/8 .. seq_len)")
    p.add_argument("--depths", type=cli.int_at_least(1), default=len(needle.DEFAULT_DEPTHS),
                   help="number of needle depths, evenly from 0%% to 100%%")
    p.add_argument("--samples", type=cli.int_at_least(1), default=4, help="passkeys per (length, depth) cell")
    p.add_argument("--seed", type=cli.int_at_least(0), default=0, help="passkey seed (0 or more)")
    add_model_flags(p, haystacks="fills the haystacks", tokenizer_default="see below")
    return p


def add_model_flags(p: argparse.ArgumentParser, *, haystacks: str, tokenizer_default: str) -> None:
    """The run's settings an evaluation may change, as _mesh_overrides, _dataset and
    _model_tokenizer read them (scripts/eval_ruler.py takes the same)."""
    p.add_argument("--seq-len", type=cli.int_at_least(1), help="run at this data.seq_len instead of the run's")
    p.add_argument("--mesh", help="DP,FSDP,SP instead of the run's mesh")
    p.add_argument("--impl", choices=("splash", "xla"), help="attention impl instead of the run's")
    p.add_argument("--data", metavar="DIR", help=f"prepared dataset whose validation text {haystacks} "
                   "(default: the run's data.path, else the embedded corpus)")
    p.add_argument("--tokenizer", metavar="SPEC", help="the model's tokenizer: byte, "
                   f"sentencepiece:MODEL or hf:DIR_OR_JSON (default: {tokenizer_default})")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax's notes about read-only checkpoint directories
    workdir_lib.check_named(args.workdir)  # "" would read the current directory

    config, directory, step = params_io.read_config(args.workdir, "--workdir")
    overrides = _mesh_overrides(args, config)
    if args.seq_len:
        overrides["data.seq_len"] = args.seq_len
    if args.impl:
        overrides["attention.impl"] = args.impl
    seq_len = args.seq_len or config.data.seq_len
    if args.lengths and max(args.lengths) > seq_len:
        raise ConfigError(f"--lengths={max(args.lengths)} is longer than the {seq_len}-token sequences "
                          f"the model runs at; pass --seq-len={max(args.lengths)} as well.")
    cli.validated(f"--workdir {args.workdir} holds a checkpoint (step {step})")
    runner, tokenizer, documents, source = model_and_documents(args, config, directory, step, overrides)
    depths = evenly_spread_depths(args.depths)
    try:
        result = needle.evaluate(runner, tokenizer, documents, lengths=args.lengths, depths=depths,
                                 samples=args.samples, seed=args.seed)
    except ValueError as e:  # a length the haystack cannot hold
        raise ConfigError(f"--lengths: {e}") from None
    result.update(step=step, workdir=args.workdir, data_dir=source.data_dir,
                  data_tokenizer=source.data_tokenizer, tokenizer=source.tokenizer,
                  tokenizer_name=tokenizer.name, tokenizer_from=source.tokenizer_from,
                  filler_retokenized=source.retokenized)
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
