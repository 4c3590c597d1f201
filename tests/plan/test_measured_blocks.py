"""attention.block_size=auto on a chip whose kernels were timed (plan/measured_blocks.py): the
block measured fastest for the run's mask at the nearest measured shard length."""
import types

import pytest

from longctx.plan import auto, measured_blocks
from tests.plan.test_planner import _config

MHA128 = dict(heads=8, kv_heads=8, head_dim=128)
TABLE = {"TPU v5 lite": [
    dict(mask="causal", shard_len=32768, block=512, fwdbwd_ms=81.5, **MHA128),
    dict(mask="causal", shard_len=32768, block=1024, fwdbwd_ms=59.3, **MHA128),
    dict(mask="causal", shard_len=32768, block=2048, fwdbwd_ms=93.7, **MHA128),
    dict(mask="causal", shard_len=4096, block=512, fwdbwd_ms=1.0, **MHA128),  # one block only
    dict(mask="causal", shard_len=262144, block=512, fwdbwd_ms=900.0, **MHA128),
    dict(mask="causal", shard_len=262144, block=2048, fwdbwd_ms=800.0, **MHA128),
]}


def _fits(shard_len):
    return lambda block: shard_len % block == 0


def _best(mask, shard_len, fits, head_dim=128, group=1, table=TABLE, chip="TPU v5 lite"):
    return measured_blocks.best_block(chip, mask, shard_len, fits, head_dim=head_dim, group=group,
                                      table=table)


def test_the_fastest_block_at_the_nearest_measured_length():
    got = _best("causal", 65536, _fits(65536))
    assert (got.block, got.shard_len) == (1024, 32768)
    got = _best("causal", 200000, lambda b: True)
    assert (got.block, got.shard_len) == (2048, 262144)
    # a length timed at one block only is no comparison: 4,096 takes 32,768's answer
    assert _best("causal", 4096, _fits(4096)).block == 1024
    # a block the shard does not take is not chosen
    assert _best("causal", 32768, lambda b: b != 1024).block == 512
    assert _best("window", 32768, _fits(32768)) is None
    assert _best("causal", 32768, _fits(32768), chip="TPU v6 lite") is None
    assert "1024, the fastest measured on TPU v5 lite for causal attention at 32,768 tokens per " \
           "device (59.3 ms forward + backward; 81.5 at 512, 93.7 at 2048" in \
           _best("causal", 32768, _fits(32768)).describe("TPU v5 lite")


def test_the_timings_of_the_nearest_head_shape_decide():
    """Rows of other head widths or groups at the same length are another kernel's timings: they
    neither overwrite nor join the nearest shape's."""
    wide = dict(heads=8, kv_heads=8, head_dim=256)
    gqa = dict(heads=32, kv_heads=8, head_dim=128)
    table = {"TPU v5 lite": TABLE["TPU v5 lite"] + [
        dict(mask="causal", shard_len=32768, block=512, fwdbwd_ms=50.0, **wide),
        dict(mask="causal", shard_len=32768, block=1024, fwdbwd_ms=70.0, **wide),
        dict(mask="causal", shard_len=32768, block=2048, fwdbwd_ms=40.0, **gqa),
        dict(mask="causal", shard_len=32768, block=1024, fwdbwd_ms=60.0, **gqa)]}
    assert _best("causal", 32768, _fits(32768), table=table).block == 1024
    assert _best("causal", 32768, _fits(32768), head_dim=256, table=table).block == 512
    assert _best("causal", 32768, _fits(32768), head_dim=192, table=table).block == 512  # nearer 256
    assert _best("causal", 32768, _fits(32768), group=4, table=table).block == 2048
    assert _best("causal", 32768, _fits(32768), group=2, table=table).block == 1024  # a tie: 1


def test_the_mask_kind_of_a_config():
    a = lambda **kw: types.SimpleNamespace(get=lambda k, d=None: kw.get(k, d))  # noqa: E731
    assert measured_blocks.mask_kind(a(causal=True)) == "causal"
    assert measured_blocks.mask_kind(a(causal=True, use_segment_ids=True)) == "documents"
    assert measured_blocks.mask_kind(a(causal=True, sliding_window=4096,
                                       use_segment_ids=True)) == "window"
    assert measured_blocks.mask_kind(a(causal=False)) == "full"


def test_auto_takes_the_measured_block_on_a_timed_chip(monkeypatch):
    monkeypatch.setattr(measured_blocks, "load", lambda path=None: TABLE)
    config = _config("tiny", attention=dict(impl="splash", block_size="auto", use_segment_ids=False,
                                            sliding_window=None, causal=True),
                     data=dict(seq_len=65536, global_batch_size=1), mesh=dict(dp=1, fsdp=1, sp=1))
    chip = types.SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")
    resolution = auto.resolve(config, [chip])
    assert resolution.config.attention.block_size == 1024
    assert resolution.chosen is None  # nothing left to the planner
    assert auto.describe(resolution).startswith("attention.block_size=auto: 1024, the fastest")
    assert config.attention.block_size == "auto"  # the caller's config is left as it was
    # an untimed chip: the planner's, which refuses a chip it has no figures for
    other = types.SimpleNamespace(device_kind="TPU v9", platform="tpu", coords=None)
    with pytest.raises(Exception, match="attention.block_size=auto"):
        auto.resolve(config, [other])
