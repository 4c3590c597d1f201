"""Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, OLMo 3) -> longctx and back,
and a logit check on the sharded model.

  # HF -> longctx: a directory that --config.checkpoint.init_from accepts; prints the overrides
  .venv/bin/python scripts/convert_hf.py to-longctx --hf=Meta-Llama-3-8B --out=runs/llama3_8b_hf
  .venv/bin/python scripts/convert_hf.py to-longctx --hf=Meta-Llama-3-8B --print-config   # overrides only

  # longctx (a converted directory or a training workdir) -> HF config.json + safetensors shards
  .venv/bin/python scripts/convert_hf.py to-hf --checkpoint=runs/llama3_8b_extend --out=hf/llama3_8b_128k \\
      --dtype=bfloat16

  # token ids through a longctx checkpoint on the sharded model (ring over sp), logits out or compared
  .venv/bin/python scripts/convert_hf.py check-logits --checkpoint=runs/llama3_8b_hf --tokens=ids.npz \\
      --mesh=1,2,4 --impl=xla --out=logits.npz

to-longctx reads config.json and model.safetensors (or the shards of model.safetensors.index.json)
lazily: each device's shard is cut from the memory-mapped file, cast to --param-dtype, and saved
with Orbax, so the host never holds a second copy. The output directory holds checkpoints/0/
(parameters only), hf_config.json (the source config.json, reused by to-hf) and
config_overrides.txt (the --config.model.* flags that describe the model, as printed).

Each family's block options and layer types are read from config.json (longctx/interop/families.py;
docs/extend.md, "Qwen, Gemma 3 and OLMo 3"); a model with sliding and full layers prints its
attention.layer_types as one quoted flag.

to-hf writes config.json (the rope_theta + rope_scaling spelling of released Llama-3.1
checkpoints, which transformers 4 and 5 both read; with rope_parameters per layer type and
layer_types for Gemma 3 and OLMo 3; the family is the source config.json's) and model.safetensors, or shards of at most
--max-shard-mb with model.safetensors.index.json. Fields longctx does not know (token ids, ...)
come from --hf-config (default: the hf_config.json beside the checkpoint's checkpoints/, which
to-longctx writes and a training run started from it with checkpoint.init_from carries along).
Both commands refuse a non-empty --out unless --overwrite is given, and then replace only an
export (a directory holding longctx_export.json, which each writes), never a directory of other
files; they write into a sibling directory that replaces --out only once complete: no older
export's file is left beside the new ones, and a failed export leaves the old one intact.

check-logits takes int token ids [batch, n] (or [n]) from a .npy, or an .npz with `tokens` and
optionally `positions`, `segment_ids` (packed rows; positions default to restarting per document),
`logits` (expected values) and `positions_index` (the positions `logits` are given at, the same
for every row; default all). Rows are padded to the shortest length the ring accepts with the
checkpoint's attention impl (or --impl; splash's blocks are multiples of 128, longctx/ops/blocks.py),
padded with empty rows to a multiple of the mesh's dp x fsdp, laid out as in training and run on
the --mesh; the logits of the real rows are written to --out and, when expected ones are given,
compared: it prints the max |difference| and exits 1 if it exceeds --tolerance.
"""

import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start()  # before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402

from longctx import config as config_lib  # noqa: E402
from longctx.train import checkpoint as checkpoint_lib  # noqa: E402
from longctx.interop import hf  # noqa: E402
from longctx.evals import inference  # noqa: E402
from longctx.interop import params_io  # noqa: E402
from longctx.interop import staging  # noqa: E402
from longctx.errors import ConfigError, MissingFileError  # noqa: E402

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "base.py")
_PARAM_DTYPES = ("float32", "bfloat16")
_HF_DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def load_config(spec: str):
    """`configs/base.py[:preset]` -> its locked ConfigDict (what --config=... gives train.py); a
    file that is missing or does not load is one line naming it (and FILE:LINE)."""
    return cli.load_config_file(spec, flag="--config")


def parse_mesh(text: str) -> dict:
    try:
        dp, fsdp, sp = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--mesh={text!r} must be three integers DP,FSDP,SP (one may be -1).") from None
    return {"mesh.dp": dp, "mesh.fsdp": fsdp, "mesh.sp": sp}


def check_hf_directory(path: str) -> None:
    """--hf names a directory here: the converter reads files and downloads nothing."""
    if not os.path.isdir(path):
        raise MissingFileError(f"--hf={path} is not a directory here: --hf takes a local directory of a Hugging "
                               "Face checkpoint (config.json and model.safetensors) and convert_hf.py downloads "
                               "nothing, so download the model's files first and pass their directory.")


def check_arguments(args) -> str:
    """--validate_only: each command's inputs read as far as their config (the HF config.json, the
    checkpoint's saved config, the token file's existence), its flags parsed, --out checked as the
    command checks it; no weights read."""
    parse_mesh(args.mesh)
    if args.command == "to-longctx":
        check_hf_directory(args.hf)
        hf.config_overrides(hf.read_config(args.hf), os.path.join(args.hf, hf.CONFIG_FILE))
        load_config(args.config)
        if not (args.out or args.print_config):
            raise ConfigError("to-longctx needs --out (or --print-config).")
        if not args.print_config:
            staging.check_destination(args.out, args.overwrite, source=("--hf", args.hf))
        return f"{args.hf} can be converted"
    if args.command == "to-hf":
        staging.check_destination(args.out, args.overwrite, source=("--checkpoint", args.checkpoint))
    params_io.read_config(args.checkpoint)
    if args.command == "check-logits" and not os.path.isfile(args.tokens):
        raise MissingFileError(f"--tokens={args.tokens} does not exist.")
    return f"{args.checkpoint} holds a checkpoint for {args.command}"


# ----------------------------------------------------------------------------- to-longctx


def to_longctx(args) -> int:
    check_hf_directory(args.hf)
    hf_config = hf.read_config(args.hf)
    overrides = hf.config_overrides(hf_config, os.path.join(args.hf, hf.CONFIG_FILE))
    overrides["model.param_dtype"] = args.param_dtype
    config = load_config(args.config)
    flags = hf.print_overrides(overrides, base=config)
    if args.print_config:
        print(flags)
        return 0
    if not args.out:
        raise ConfigError("to-longctx needs --out (or --print-config).")
    staging.check_destination(args.out, args.overwrite, source=("--hf", args.hf))  # before minutes of reading
    if hf.ignored_index(args.hf):
        print(f"convert_hf: {args.hf} holds both {hf.SINGLE_FILE} and {hf.INDEX_FILE}; reading "
              f"{hf.SINGLE_FILE}, as transformers does.")
    config_lib.apply_overrides(config, overrides)
    import jax

    run_config = config.copy_and_resolve_references()
    # Conversion only shards for memory: every device holds a slice of every weight (fsdp).
    config_lib.apply_overrides(run_config, {**parse_mesh(args.mesh), "data.global_batch_size": jax.device_count()})
    runner = inference.make_runner(run_config, lambda abstract, shardings: hf.load_params(
        args.hf, config, abstract, shardings))
    step_dir = params_io.save(args.out, config, runner.params, source=os.path.abspath(args.hf),
                              overwrite=args.overwrite, files={
                                  checkpoint_lib.HF_CONFIG_FILE: json.dumps(hf_config, indent=2),
                                  "config_overrides.txt": flags + "\n"})
    print(f"convert_hf: wrote {step_dir} ({config.model.num_layers} layers, vocab {config.model.vocab_size}, "
          f"{args.param_dtype}); start a run from it with --config.checkpoint.init_from={args.out} and "
          f"these overrides (also in {args.out}/config_overrides.txt):\n{flags}")
    return 0


# ----------------------------------------------------------------------------- to-hf


def to_hf(args) -> int:
    import jax

    staging.check_destination(args.out, args.overwrite, source=("--checkpoint", args.checkpoint))  # before reading
    template_path = args.hf_config or params_io.hf_config_path(args.checkpoint)
    template = None
    if os.path.isfile(template_path):
        with open(template_path) as f:
            template = json.load(f)
    elif args.hf_config:
        raise MissingFileError(f"--hf-config={args.hf_config} does not exist.")
    dtype = args.dtype or (template or {}).get("torch_dtype") or (template or {}).get("dtype") or "float32"
    if dtype not in _HF_DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(_HF_DTYPES)}.")
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else _HF_DTYPES[dtype]
    runner = inference.runner_from_checkpoint(args.checkpoint, {
        **parse_mesh(args.mesh), "data.global_batch_size": jax.device_count(), "attention.impl": "xla"})
    written = hf.write_hf(runner.params, runner.config, args.out, dtype=np_dtype, template=template,
                          max_shard_bytes=int(args.max_shard_mb * (1 << 20)), overwrite=args.overwrite)
    print(f"convert_hf: wrote {args.out}: {', '.join(written)} ({dtype})")
    return 0


# ----------------------------------------------------------------------------- check-logits


def _read_tokens(path: str) -> dict:
    if not os.path.isfile(path):
        raise MissingFileError(f"--tokens={path} does not exist.")
    try:
        loaded = np.load(path)  # (allow_pickle=False: numpy's ValueError for any other file)
    except (ValueError, OSError):
        raise ConfigError(f"--tokens={path} is not a .npy or .npz file: write the token ids with numpy.save "
                          "(an int array [batch, n]) or numpy.savez (tokens=..., and the optional arrays "
                          "convert_hf.py -h lists).") from None
    rows = {"tokens": loaded} if isinstance(loaded, np.ndarray) else {k: loaded[k] for k in loaded.files}
    if "tokens" not in rows:
        raise ConfigError(f"--tokens={path} has no array named 'tokens'.")
    return rows


def _logit_positions(rows: dict, n: int, source: str) -> np.ndarray:
    """`positions_index` (the same for every row; default all n), checked."""
    where = np.asarray(rows.get("positions_index", np.arange(n)))
    if where.ndim != 1 or not np.issubdtype(where.dtype, np.integer) or (
            where.size and (where.min() < 0 or where.max() >= n)):
        raise ConfigError(f"{source}: 'positions_index' must be a list of integer positions in [0, {n}).")
    return where


def check_logits(args) -> int:
    import jax

    from longctx.ops import blocks
    from longctx.parallel import mesh as mesh_lib

    config, _, _ = params_io.read_config(args.checkpoint)
    source = f"--tokens={args.tokens}"
    given = _read_tokens(args.tokens)
    rows = inference.check_rows(given, config.model.vocab_size, source)
    b, n = rows["tokens"].shape
    where_1d = _logit_positions(given, n, source)
    mesh = parse_mesh(args.mesh)
    try:
        sizes = mesh_lib.resolve_mesh_shape(
            {"dp": mesh["mesh.dp"], "fsdp": mesh["mesh.fsdp"], "sp": mesh["mesh.sp"], "dcn_dp": 1,
             "dcn_fsdp": 1, "dcn_sp": 1}, jax.device_count())
    except ValueError as e:
        raise ConfigError(f"--mesh={args.mesh}: {e}") from None
    sp, ways = sizes["sp"], sizes["dp"] * sizes["fsdp"]
    impl = args.impl or config.attention.impl
    layout = config.attention.layout if config.attention.layout != "auto" else "zigzag"
    if args.block_size and (args.block_size < 1 or args.block_size % blocks.block_multiple(impl)):
        raise ConfigError(f"--block-size={args.block_size} must be a positive multiple of "
                          f"{blocks.block_multiple(impl)} for attention impl {impl!r}.")
    # The rows' shortest padding that some block (splash: 128 or more) fits, with the largest
    # block at that length; or the length --block-size needs.
    largest = args.block_size or config.attention.block_size
    seq_len, block = blocks.padded_length(n, sp, impl, layout, largest,
                                          smallest=args.block_size or None)
    overrides = {**mesh, "attention.layout": layout, "attention.block_size": block, "attention.impl": impl,
                 "data.seq_len": seq_len, "data.global_batch_size": -(-b // ways) * ways,
                 "train.loss_chunk_size": seq_len // sp, "model.dtype": args.dtype}
    runner = inference.runner_from_checkpoint(args.checkpoint, overrides)
    logits = runner.logits_at(rows, np.tile(where_1d, (b, 1)))
    print(f"convert_hf: logits [{b}, {len(where_1d)}, {logits.shape[-1]}] from {args.checkpoint} on mesh "
          f"{dict(runner.mesh.shape)}, layout {runner.layout}, attention impl {runner.config.attention.impl} "
          f"(block {runner.config.attention.block_size}), {n} tokens per row padded to {seq_len}")
    if args.out:
        np.savez(args.out, logits=logits, positions_index=where_1d)
        print(f"convert_hf: wrote {args.out}")
    if "logits" in given:
        expected = np.asarray(given["logits"], np.float32)
        if expected.shape != logits.shape:
            raise ConfigError(f"{source}: 'logits' has shape {list(expected.shape)}, "
                              f"the model gives {list(logits.shape)}.")
        diff = float(np.max(np.abs(logits - expected)))
        ok = diff <= args.tolerance
        print(f"convert_hf: max |logit difference| = {diff:.3g} over {expected.size:,} logits "
              f"(tolerance {args.tolerance:g}): {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The three commands' flags, each number with its range (a value outside it is one line)."""
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("to-longctx", help="HF checkpoint directory -> longctx checkpoint")
    a.add_argument("--hf", required=True, metavar="DIR", help="config.json + model.safetensors[.index.json]")
    a.add_argument("--out", metavar="DIR", help="output directory (for --config.checkpoint.init_from)")
    a.add_argument("--print-config", action="store_true", help="only print the --config overrides")
    a.add_argument("--config", default=_DEFAULT_CONFIG, metavar="FILE[:PRESET]",
                   help="config the overrides are relative to and the saved config starts from")
    a.add_argument("--param-dtype", default="float32", choices=_PARAM_DTYPES,
                   help="longctx parameter dtype (float32 master weights for training)")
    a.add_argument("--mesh", default="1,-1,1", help="DP,FSDP,SP mesh the weights are sharded over while converting")
    a.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out (the old contents are kept until the new ones are complete)")

    b = sub.add_parser("to-hf", help="longctx checkpoint -> HF config.json + safetensors")
    b.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a converted directory, a training workdir, its checkpoints/ or a step directory")
    b.add_argument("--out", required=True, metavar="DIR")
    b.add_argument("--dtype", choices=tuple(_HF_DTYPES), help="tensor dtype (default: the source model's, else float32)")
    b.add_argument("--hf-config", metavar="FILE", help="source config.json whose other fields to keep")
    b.add_argument("--max-shard-mb", type=cli.float_above(0), default=5000.0,
                   help="largest safetensors file, in MiB (more than 0)")
    b.add_argument("--mesh", default="1,-1,1", help="DP,FSDP,SP mesh the parameters are restored onto")
    b.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out (the old export is kept until the new one is complete)")

    c = sub.add_parser("check-logits", help="run token ids through a longctx checkpoint, write/compare logits")
    c.add_argument("--checkpoint", required=True, metavar="PATH")
    c.add_argument("--tokens", required=True, metavar="FILE", help=".npy token ids or .npz (see above)")
    c.add_argument("--out", metavar="FILE.npz", help="write the logits here")
    c.add_argument("--mesh", default="1,1,-1", help="DP,FSDP,SP (default: every device on the ring)")
    c.add_argument("--impl", choices=("splash", "xla"), help="attention impl (default: the checkpoint's)")
    c.add_argument("--block-size", type=cli.int_at_least(0), default=0,
                   help="attention block (default 0: chosen to limit padding)")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    c.add_argument("--tolerance", type=cli.float_at_least(0), default=1e-4,
                   help="max |logit difference| accepted (0 or more)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # Orbax's notes about read-only checkpoint directories
    if cli.validate_only():
        cli.validated(check_arguments(args))
    return {"to-longctx": to_longctx, "to-hf": to_hf, "check-logits": check_logits}[args.command](args)


if __name__ == "__main__":
    cli.run(main)
