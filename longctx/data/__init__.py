"""Grain data pipeline: sources, tokenizer, packing, host sharding, layout permutation.

The train loop's interface:
  resolve_dataset(config) -> data_dir
  load_metadata(data_dir) -> dict
  check_splits(config, metadata, data_dir, mesh): the splits the run reads are not too small
  layout_sample(config, data_dir) -> segment ids of the rows attention.layout='auto' is chosen on
  make_batch_iterator(config, mesh, *, split, layout, data_dir, seed_offset=0, source=None)
  validation_sources(config), achieved_shares(config, sp), describe_shares(shares),
  describe_data(config, data_dir): mixtures
  check_sources(config, mesh): --validate_only's check of every source (writes nothing)
These read data.path (pipeline.py) or the mixture of data.sources (mixture.py). See pipeline.py for the batch format and the Orbax checkpoint recipe for the iterator.

Names are imported lazily so that `longctx.data.prepare` (the data-preparation CLI) starts
without importing grain and jax.
"""

import importlib

_EXPORTS = {
    "KEYS": "packing", "PACKERS": "packing", "packer_layout": "packing",
    "BatchIterator": "pipeline", "check_splits": "mixture", "load_metadata": "pipeline",
    "make_batch_iterator": "mixture", "layout_sample": "mixture", "packed_rows": "pipeline",
    "resolve_dataset": "mixture", "validation_sources": "mixture", "achieved_shares": "mixture",
    "describe_shares": "mixture", "describe_data": "mixture", "check_sources": "mixture",
    "DataShard": "sharding", "data_shard": "sharding",
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"longctx.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'longctx.data' has no attribute {name!r}")
