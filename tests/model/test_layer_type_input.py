"""What a person types for layer types: each mistake one sentence before anything compiles, each
key docs/attention.md lists settable by flag, and a type that is a global layer in disguise said
once at start-up.

The flags go through scripts/train.py --validate_only (tests/validate_commands.py: one import of jax
for them all); the rest calls longctx directly.
"""

import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.model import layer_types
from longctx.plan import auto
from tests.validate_commands import run_scripts


def hybrid():
    c = base.get_config("tiny_hybrid")
    c.unlock()
    return c


def refusal(config) -> str:
    with pytest.raises(ConfigError) as e:
        config_lib.validate(config, num_devices=8)
    message = str(e.value)
    assert "\n" not in message and message.replace("e.g. ", "").count(". ") == 0, message  # (one sentence)
    return message


def test_layer_types_without_a_pattern_are_refused():
    config = hybrid()
    config.attention.pattern = ""
    assert refusal(config) == (
        "attention.layer_types defines global, local but attention.pattern is empty, so no layer is of them: "
        "name them in --config.attention.pattern (one period, in order, e.g. global,local) or set "
        "--config.attention.layer_types={}.")


def test_a_type_the_pattern_does_not_name_is_refused():
    """(A misspelt type name in a flag defines a new type, which no layer would use.)"""
    config = hybrid()
    config.attention.layer_types["glboal"] = {"rope_theta": 500_000.0}
    assert refusal(config) == ("attention.layer_types.glboal is defined but attention.pattern="
                               "'local,local,local,local,local,global' names no layer of it: add it to the "
                               "pattern, or fix its name if it is misspelt.")


def test_an_empty_pattern_entry_is_refused():
    config = hybrid()
    config.attention.pattern = "local,,global"
    assert refusal(config) == ("attention.pattern='local,,global' has an empty entry (position 2): name a layer "
                               "type at every position, e.g. local,global.")


def test_a_window_or_chunk_over_the_whole_row_is_said_to_be_a_global_layer():
    config = hybrid()
    assert layer_types.whole_row_notes(config) == []  # (window 128 of 1,024 tokens)
    config.attention.layer_types.local.sliding_window = config.data.seq_len - 1
    config.attention.layer_types["global"] = {"chunk_size": config.data.seq_len}
    assert layer_types.whole_row_notes(config) == [
        "attention.layer_types.local.sliding_window=1023 reaches every earlier key of the 1,024-token rows "
        "(data.seq_len), so its layers are global layers in disguise: set it below 1023 for local ones, or "
        "unset it.",
        "attention.layer_types.global.chunk_size=1024 holds the whole 1,024-token rows (data.seq_len) in one "
        "chunk, so its layers are global layers in disguise: set it below 1024 for chunked ones, or unset it."]
    config.attention.layer_types.local.sliding_window = config.data.seq_len - 2
    config.attention.layer_types["global"] = {"chunk_size": config.data.seq_len - 1}
    assert layer_types.whole_row_notes(config) == []
    uniform = base.get_config("tiny")
    uniform.attention.sliding_window = 4096
    assert [note.split(" reaches")[0] for note in layer_types.whole_row_notes(uniform)] == [
        "attention.sliding_window=4096"]


class _Cpu:
    device_kind, platform = "cpu", "cpu"


def test_a_types_cp_auto_off_the_planners_chips_names_the_types_key_and_a_fix_that_works():
    config = hybrid()
    config.attention.layer_types.local.cp = "auto"
    with pytest.raises(ConfigError) as e:
        auto.resolve(config, [_Cpu()] * 8)
    message = str(e.value)
    assert message.startswith("attention.layer_types.local.cp=auto needs the step-time model's figures"), message
    assert message.endswith("set --config.attention.layer_types.local.cp=ring (or all_gather, ulysses, usp)."), message
    config.attention.layer_types.local.cp = "ring"  # the fix it names
    config_lib.validate(config, num_devices=8)


def test_every_key_of_a_type_can_be_set_by_flag(tmp_path):
    """A type holds only what sets it apart, so the preset's `local` has no chunk_size and its
    `global` no window: both are still keys of the type (docs/attention.md), as is a new type."""
    train = ["scripts/train.py", "--config=configs/base.py:tiny_hybrid", f"--workdir={tmp_path / 'run'}",
             "--validate_only"]
    results = run_scripts([
        train + ["--config.attention.layer_types.local.chunk_size=64",
                 "--config.attention.layer_types.global.sliding_window=512"],
        train + ["--config.attention.layer_types.local.chunk_size=-1"],  # (set: validate sees it)
        train + ["--config.attention.pattern=local,mid,global", "--config.attention.layer_types.mid.rope=false",
                 "--config.attention.layer_types.mid.sliding_window=None"],
        train + ["--config.attention.layer_types.mid.rope=false"],  # (a type no pattern names: refused)
        train + ["--config.attention.layer_types.local.chunksize=64"],
    ])
    assert [r["returncode"] for r in results] == [0, 2, 0, 2, 2], results
    lines = [(r["stdout"] + r["stderr"]).strip().splitlines()[-1] for r in results]
    assert lines[1] == "longctx: attention.layer_types.local.chunk_size=-1 must be positive.", lines[1]
    assert lines[3].startswith("longctx: attention.layer_types.mid is defined but attention.pattern="), lines[3]
    assert lines[4] == (
        "longctx: unknown config key attention.layer_types.local.chunksize in "
        "--config.attention.layer_types.local.chunksize=64; the keys a layer type sets, closest first: chunk_size, "
        + lines[4].split("closest first: chunk_size, ", 1)[1]), lines[4]


def test_a_grid_variant_sets_a_key_its_type_does_not_have_yet():
    config = hybrid()
    config_lib.apply_overrides(config, {"attention.layer_types.local.chunk_size": 64,
                                        "attention.layer_types.global.rope_theta": 500_000.0})
    assert config.attention.layer_types.local.chunk_size == 64
    assert config.attention.layer_types["global"].rope_theta == 500_000.0
    with pytest.raises(KeyError):
        config_lib.apply_overrides(config, {"attention.layer_types.local.chunksize": 64})
