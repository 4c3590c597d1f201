"""Tokenize text/jsonl/directory trees into ArrayRecord shards + metadata.json for longctx.

  .venv/bin/python scripts/prepare_data.py --input books/ notes.txt --glob '*.txt' --output data/mine
  .venv/bin/python scripts/prepare_data.py --input corpus.jsonl --text-field body --output data/j
  .venv/bin/python scripts/prepare_data.py --input corpus.jsonl --tokenizer sentencepiece:sp.model --output d
  .venv/bin/python scripts/prepare_data.py --input corpus.jsonl --train-sentencepiece 8000 --output d
  .venv/bin/python scripts/prepare_data.py --input corpus.jsonl --tokenizer hf:Meta-Llama-3-8B --output d
  .venv/bin/python scripts/prepare_data.py --input web.jsonl.zst pages.parquet --text-field text --output d
  .venv/bin/python scripts/prepare_data.py --input hf_saved_dataset/ --output d

Plain files are one document each; `.jsonl` files (also `.jsonl.gz`, `.jsonl.zst`) give one
document per line (field --text-field), Parquet files and the Arrow files of a Hugging Face
`datasets.save_to_disk` directory one per row (column --text-field; these need
`pip install -e '.[formats]'`); directories are walked for files matching --glob. Plain files that are not text
in --encoding (they do not decode, or hold NUL bytes) are skipped, and one line on stderr says
how many and names one; so are blank documents (empty or whitespace only). An empty split (no
validation documents: --val-fraction 0, or a single input document) is warned about on stderr:
training with evaluation refuses such a dataset at start-up. A prepared dataset among the inputs
(e.g. an earlier --output inside an input directory) is never read as text. Output: train-*.array_record, validation-*.array_record (int32 ids,
BOS ... EOS per record), metadata.json, and tokenizer.model for SentencePiece (tokenizer.json
and tokenizer_config.json for hf:, whose BOS/EOS come from that config). An existing
--output is replaced only with --overwrite. Re-running on the same input writes byte-identical
files. Train with it via --config.data.path=DIR (and model.vocab_size >= the vocab_size in
metadata.json).
"""

import argparse
import os
import sys

# longctx from this checkout even without .venv, so that cli.start() can say in one line what is missing
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from longctx import cli  # noqa: E402

cli.start(cpu_devices=None)  # no jax here

from longctx.data import prepare  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def check_arguments(args) -> str:
    """--validate_only: the inputs exist, the output may be written, the tokenizer loads (nothing
    is read past the directory listing, nothing is written)."""
    from longctx.data import tokenizer as tokenizer_lib

    sources = prepare.list_sources(args.input, args.glob)
    if not 0.0 <= args.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction={args.val_fraction} must be in [0, 1).")
    output = os.path.abspath(args.output)
    if os.path.isfile(output):
        raise ConfigError(f"--output {output} exists and is not a longctx dataset directory; "
                          "choose another --output.")
    if os.path.isdir(output) and os.listdir(output) and not args.overwrite:
        raise ConfigError(f"--output {output} already holds a dataset; pass --overwrite to "
                          "replace it, or choose another --output.")
    if not args.train_sentencepiece:
        tokenizer_lib.load_tokenizer(args.tokenizer)
    return f"{len(sources)} input file(s), --output {args.output}, tokenizer {args.tokenizer}"


def build_parser() -> argparse.ArgumentParser:
    """The flags, each number with its range (a value outside it is one line naming the flag)."""
    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text files, .jsonl(.gz|.zst), .parquet or .arrow files, or directories")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset in --output")
    p.add_argument("--tokenizer", default="byte",
                   help="byte | sentencepiece:MODEL_FILE | hf:TOKENIZER_JSON_OR_MODEL_DIR")
    p.add_argument("--train-sentencepiece", type=cli.int_at_least(1), default=None, metavar="VOCAB",
                   help="train a BPE SentencePiece model of this vocabulary size on the input first")
    p.add_argument("--text-field", default="text", help="JSONL field, or Parquet/Arrow column, holding the document")
    p.add_argument("--encoding", default="utf-8",
                   help="encoding of plain text files; files that do not decode are skipped")
    p.add_argument("--glob", default="*", help="file-name pattern for directory inputs")
    p.add_argument("--val-fraction", type=cli.float_at_least(0), default=0.01,
                   help="share of the documents held out for validation, in [0, 1)")
    p.add_argument("--shard-mb", type=cli.int_at_least(1), default=prepare.DEFAULT_SHARD_BYTES >> 20,
                   help="start a new ArrayRecord file after this many MiB of token ids")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if cli.validate_only():
        cli.validated(check_arguments(args))
    meta = prepare.prepare(
        args.input, args.output, overwrite=args.overwrite, tokenizer=args.tokenizer,
        text_field=args.text_field, encoding=args.encoding, glob=args.glob,
        val_fraction=args.val_fraction, train_sentencepiece=args.train_sentencepiece,
        shard_bytes=args.shard_mb << 20, progress=not args.quiet)
    if meta["num_skipped_files"]:
        print(f"prepare_data: skipped {meta['num_skipped_files']} of {meta['num_source_files']} "
              f"input files that are not {meta['encoding']} text, e.g. "
              f"{meta['skipped_file_example']}.", file=sys.stderr)
    if meta["num_empty_documents"]:
        print(f"prepare_data: dropped {meta['num_empty_documents']} empty or whitespace-only "
              f"document(s), e.g. {meta['empty_document_example']}.", file=sys.stderr)
    for warning in prepare.empty_split_warnings(meta):
        print(f"prepare_data: WARNING: {warning}", file=sys.stderr)
    s = meta["splits"]
    print(f"prepare_data: {args.output}: {meta['num_documents']:,} documents, "
          f"{meta['num_tokens']:,} tokens (train {s['train']['num_documents']:,} docs / "
          f"{s['train']['num_tokens']:,} tokens, validation {s['validation']['num_documents']:,} "
          f"docs / {s['validation']['num_tokens']:,} tokens), tokenizer {meta['tokenizer']}, "
          f"vocab {meta['vocab_size']}.")
    return 0


if __name__ == "__main__":
    cli.run(main)
