"""The memory model against the TPU compiler's own figure for a strategy's working set: the whole
train step compiled ahead of time for v5p:2x2x2 (plan/aot.py, as the calibration's memory points
are: benchmarks/calibrate_planner.py), within the error the calibration allows
(tests/plan/test_planner.py: 25%). A small model at a length where one layer's attention arrays
are a large part of the step, so that a strategy priced as another shows.

The halo holds 1 + E shard-sized K/V buffers and float32 dK/dV for each, E its exchanges: two in
zigzag for a window no longer than half a shard (a chunk of each neighbour), sp - 1 in striped,
where the window reaches every shard (the whole sequence, as all-gather)."""
import copy
import os

import pytest

from configs import base
from longctx.plan import aot, collectives, memory_model

needs_libtpu = pytest.mark.skipif(not aot.libtpu_available(),
                                  reason="libtpu is not installed (make test installs it via the [tpu] extra)")

SP = 8
MESH = {"dp": 1, "fsdp": 1, "sp": SP}


def _config(cp: str, layout: str, window: int):
    """Two small layers with 8 K/V heads of 128 at 16,384 tokens in bf16 (splash, blocks of 512):
    the K/V a strategy holds for one layer are a large part of the step."""
    c = copy.deepcopy(base.get_config("tiny"))
    c.unlock()
    c.model.update(dtype="bfloat16", d_model=256, num_heads=8, num_kv_heads=8, head_dim=128,
                   mlp_dim=512, num_layers=2, remat_policy="nothing_saveable")
    c.attention.update(impl="splash", block_size=512, cp=cp, layout=layout, sliding_window=window)
    c.data.update(seq_len=16_384, global_batch_size=1)
    c.mesh.update(**MESH)
    c.train.update(loss_chunk_size=2048)
    c.lock()
    return c


CASES = [("zigzag", 1024, 2), pytest.param("striped", 4096, SP - 1, marks=pytest.mark.skipif(
    not os.environ.get("LONGCTX_EXHAUSTIVE"), reason="the striped compile runs with LONGCTX_EXHAUSTIVE=1 (its "
    "exchange count by default in test_the_halo_exchanges_each_layout_needs; the halo's buffers priced per "
    "exchange by the zigzag compile)"))]


def _exchanges(c) -> int:
    m = c.model
    shape = collectives.Shape(batch=1, seq_len=c.data.seq_len, sp=SP, heads=m.num_heads,
                              kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    return len(collectives.halo_exchanges(shape, sliding_window=(c.attention.sliding_window, 0),
                                          layout=c.attention.layout))


@pytest.mark.parametrize("layout,window,exchanges", [("zigzag", 1024, 2), ("striped", 4096, SP - 1)])
def test_the_halo_exchanges_each_layout_needs(layout, window, exchanges):
    assert _exchanges(_config("halo", layout, window)) == exchanges


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.parametrize("layout,window,exchanges", CASES)
def test_the_halo_s_memory_is_the_shards_it_holds(layout, window, exchanges):
    c = _config("halo", layout, window)
    assert _exchanges(c) == exchanges
    compiled = aot.compile_train_step(c, "v5p:2x2x2")
    predicted = memory_model.per_device_bytes(c, MESH).total_bytes
    measured = compiled.total_bytes
    assert abs(predicted / measured - 1) < 0.25, (predicted / 2 ** 20, measured / 2 ** 20)
