"""Grain data pipeline: sources, tokenizer, packing, host sharding, layout permutation.

The train loop's interface:
  resolve_dataset(config) -> data_dir
  load_metadata(data_dir) -> dict
  make_batch_iterator(config, mesh, *, split, layout, data_dir, seed_offset=0) -> BatchIterator
See pipeline.py for the batch format and the Orbax checkpoint recipe for the iterator.
"""

from longctx.data.packing import KEYS, PACKERS
from longctx.data.pipeline import (
    BatchIterator,
    load_metadata,
    make_batch_iterator,
    packed_rows,
    resolve_dataset,
)
from longctx.data.sharding import DataShard, data_shard
from longctx.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "KEYS", "PACKERS", "BatchIterator", "DataShard", "Tokenizer", "data_shard", "load_metadata",
    "load_tokenizer", "make_batch_iterator", "packed_rows",
    "resolve_dataset",
]
