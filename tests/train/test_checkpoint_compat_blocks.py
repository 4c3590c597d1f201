"""Resume and init_from compare the model families' block options and the layer types.

A block option that adds parameters (qk_norm, qkv_bias, norm_position) is a shape key; one that
does not (norm_plus_one, mlp_activation, scale_embeddings, query_pre_attn_scalar) is refused on
resume and, on init_from, unless checkpoint.init_from_allow names it. The layer types follow the
attention keys' rule: a type's mask or RoPE is compared on init_from (refused unless allowed, a
type's own RoPE scaling listed as an extension) and on resume (one line, the run trains on); a
type's attention_sinks is a shape.
A config saved before these keys existed reads each as its default: the 2373a90 fixture (saved
without any of them) is the model it was. Each Checkpointer here reads configs only (no compile).
"""

import json
import os
import shutil

import pytest

from configs import base
from longctx import config as config_lib
from longctx.errors import ConfigError
from longctx.train import checkpoint as checkpoint_lib
from longctx.train import checkpoint_compat as compat
from tests import FIXTURES

FIXTURE = os.path.join(FIXTURES, "checkpoint_2373a90")
SAVED_CONFIG = os.path.join("checkpoints", "2", "config", "metadata")  # (Orbax's JSON of the config)


def fixture_config():
    """The fixture's model (made_by.json's shapes) as today's code builds it: every block option at
    its default."""
    return fixture_shapes(base.get_config("tiny"))


def fixture_shapes(c):
    c.model.update(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
    c.data.update(seq_len=256, global_batch_size=2)
    c.attention.block_size = 32
    c.train.loss_chunk_size = 64
    return c


def saved_with(tmp_path, name="saved", **changes) -> str:
    """A copy of the fixture whose saved config has `changes` ({"model": {...}, ...}) over it."""
    workdir = shutil.copytree(FIXTURE, str(tmp_path / name))
    path = os.path.join(workdir, SAVED_CONFIG)
    saved = json.load(open(path))
    for section, values in changes.items():
        saved[section].update(values)
    with open(path, "w") as f:
        json.dump(saved, f)
    return workdir


def refusal(workdir: str, config) -> str:
    with pytest.raises(ConfigError) as raised:
        checkpoint_lib.Checkpointer(workdir, config)
    message = str(raised.value)
    assert "\n" not in message and message.count(". ") <= 1, message  # (one sentence, then the fix)
    return message


def accepted(workdir: str, config) -> list[str]:
    checkpointer = checkpoint_lib.Checkpointer(workdir, config)
    checkpointer.close()
    return checkpointer._init_from_changes


def test_a_config_saved_before_the_block_options_reads_them_as_their_defaults(tmp_path, capsys):
    saved = json.load(open(os.path.join(FIXTURE, SAVED_CONFIG)))
    block_keys = [k.split(".")[1] for k in compat.ABSENT_MEANS if k.startswith("model.")]
    assert not set(block_keys) & set(saved["model"]) and "pattern" not in saved["attention"]  # (the premise)
    config = fixture_config()
    assert compat.model_shape_error(config, "x", saved) is None
    assert compat.section_differences(saved, config.to_dict(), "model", skip=compat.SHAPE_KEYS) == []
    assert compat.init_from_differences(saved, config.to_dict(), ()) == ([], [])
    # Through the Checkpointer: the workdir resumes, and init_from starts, without a word of change.
    assert accepted(shutil.copytree(FIXTURE, str(tmp_path / "run")), config) == []
    config.checkpoint.init_from = FIXTURE
    assert accepted(str(tmp_path / "new"), config) == []
    assert "changed model settings" not in capsys.readouterr().out


def test_norm_plus_one_saved_and_not_set_is_refused_on_resume(tmp_path):
    workdir = saved_with(tmp_path, model={"norm_plus_one": True})
    message = refusal(workdir, fixture_config())
    assert message == (f"the model in {workdir}/checkpoints (step 2) differs from this config: "
                       "model.norm_plus_one: checkpoint True vs config False. Set these as the checkpoint "
                       "has them to resume it, or use a new workdir for this model."), message
    config = fixture_config()
    config.model.norm_plus_one = True
    accepted(workdir, config)


def test_norm_plus_one_saved_and_not_set_is_refused_on_init_from_unless_allowed(tmp_path):
    source = saved_with(tmp_path, model={"norm_plus_one": True})
    config = fixture_config()
    config.checkpoint.init_from = source
    message = refusal(str(tmp_path / "new"), config)
    assert message == (f"the model in checkpoint.init_from={source!r} (step 2) computes another function than "
                       "this config's: model.norm_plus_one: checkpoint True vs config False; set them as the "
                       "checkpoint has, or pass --config.checkpoint.init_from_allow=model.norm_plus_one if "
                       "the change is meant."), message
    config.checkpoint.init_from_allow = "model.norm_plus_one"
    config_lib.validate(config)
    assert accepted(str(tmp_path / "new"), config) == ["model.norm_plus_one: checkpoint True vs config False"]


@pytest.mark.parametrize("key,value", [("mlp_activation", "gelu_tanh"), ("scale_embeddings", True),
                                       ("query_pre_attn_scalar", 256.0)])
def test_each_block_option_without_parameters_is_compared(tmp_path, key, value):
    source = saved_with(tmp_path, model={key: value})
    text = f"model.{key}: checkpoint {value!r} vs config {base.get_config().model[key]!r}"
    assert text in refusal(source, fixture_config())
    config = fixture_config()
    config.checkpoint.init_from = source
    assert f"this config's: {text}; " in refusal(str(tmp_path / "new"), config)


@pytest.mark.parametrize("key,value", [("qk_norm", "per_head"), ("qkv_bias", True), ("norm_position", "sandwich")])
def test_each_block_option_with_parameters_is_a_shape(tmp_path, key, value):
    source = saved_with(tmp_path, model={key: value})
    config = fixture_config()
    config.checkpoint.init_from = source
    message = refusal(str(tmp_path / "new"), config)
    assert f"differs from this config: model.{key}: checkpoint {value!r} vs config " in message, message
    assert message.endswith("or start from a checkpoint of this model's shape."), message


# ----------------------------------------------------------------------------- layer types

def hybrid(**local):
    """tiny_hybrid with `local` over its local type's keys."""
    c = base.get_config("tiny_hybrid")
    c.unlock()
    c.attention.layer_types.local.update(local)
    return c


def test_a_layer_types_window_is_refused_on_init_from_and_allowed_by_its_key(tmp_path):
    hybrid_saved = hybrid().to_dict()
    source = saved_with(tmp_path, model={"num_layers": 6},
                        attention={k: hybrid_saved["attention"][k] for k in ("pattern", "layer_types")})
    config = fixture_shapes(hybrid(sliding_window=64))
    # Resume: a mask key may change (as attention.sliding_window may), the parameters are the same.
    accepted(source, config)
    config.checkpoint.init_from = source
    text = "attention.layer_types.local.sliding_window: checkpoint 128 vs config 64"
    message = refusal(str(tmp_path / "new"), config)
    assert f"this config's: {text}; " in message and \
        "--config.checkpoint.init_from_allow=attention.layer_types.local.sliding_window if" in message, message
    config.checkpoint.init_from_allow = "attention.layer_types.local.sliding_window"
    config_lib.validate(config)
    assert accepted(str(tmp_path / "new"), config) == [text]


def saved_hybrid(tmp_path, name="saved"):
    """The fixture with tiny_hybrid's pattern and layer types (6 layers) in its saved config."""
    hybrid_saved = hybrid().to_dict()
    return saved_with(tmp_path, name, model={"num_layers": 6},
                      attention={k: hybrid_saved["attention"][k] for k in ("pattern", "layer_types")})


NOTICE = "longctx: resuming with another attention than the checkpoint's (the parameters fit, so it trains on): "


@pytest.mark.parametrize("change, line", [
    (lambda c: setattr(c.attention, "pattern", "local,local,global"),
     "attention.pattern: checkpoint 'local,local,local,local,local,global' vs config 'local,local,global' "
     "(layer 2's sliding_window: checkpoint 128 vs config None); to train the checkpoint's model on, pass "
     "--config.attention.pattern=local,local,local,local,local,global"),
    (lambda c: c.attention.layer_types.local.update(sliding_window=64),
     "attention.layer_types.local.sliding_window: checkpoint 128 vs config 64; to train the checkpoint's model "
     "on, pass --config.attention.layer_types.local.sliding_window=128"),
    (lambda c: c.attention.layer_types["global"].update(rope_theta=500_000.0),
     "attention.layer_types.global.rope_theta: checkpoint 1000000.0 vs config 500000.0; to train the "
     "checkpoint's model on, pass --config.attention.layer_types.global.rope_theta=1000000.0"),
    (lambda c: setattr(c.attention, "logits_soft_cap", 30.0),
     "attention.logits_soft_cap: checkpoint None vs config 30.0; to train the checkpoint's model on, pass "
     "--config.attention.logits_soft_cap=None"),
])
def test_a_resume_with_another_pattern_or_layer_type_says_so_in_one_line(tmp_path, capsys, change, line):
    """The parameters fit, so the run trains on (as with another model.rope_theta), with one line
    naming the key, both values and the flags that keep the checkpoint's model."""
    workdir = saved_hybrid(tmp_path)
    config = fixture_shapes(hybrid())
    accepted(workdir, config)
    assert "attention" not in capsys.readouterr().out  # (the same model: no line)
    change(config)
    accepted(workdir, config)
    out = capsys.readouterr().out
    assert out == NOTICE + line + "\n", out


def test_a_uniform_checkpoint_resumed_as_a_hybrid_says_how_to_stay_uniform():
    uniform = fixture_config()
    uniform.model.num_layers = 6
    notice = compat.attention_notice(uniform.to_dict(), fixture_shapes(hybrid()).to_dict())
    assert notice.startswith("resuming with another attention than the checkpoint's (the parameters fit, so it "
                             "trains on): attention.pattern: checkpoint '' vs config "), notice
    assert notice.endswith("pass --config.attention.pattern= --config.attention.layer_types={}"), notice


@pytest.mark.parametrize("allow", ["attention.layer_types.local.cp", "attention.layer_types.nosuch.sliding_window"])
def test_init_from_allow_names_only_a_compared_key_of_a_defined_type(allow):
    config = hybrid()
    config.checkpoint.init_from_allow = allow
    with pytest.raises(ConfigError, match=rf"init_from_allow names '{allow}', which init_from does not compare"):
        config_lib.validate(config)


def test_layer_types_compared_layer_by_layer():
    saved = hybrid().to_dict()

    def differences(config):
        return compat.init_from_differences(saved, config.to_dict(), ())

    assert differences(hybrid()) == ([], [])
    # Renamed types compute what they did.
    renamed = hybrid()
    renamed.attention.pattern = "near,near,near,near,near,far"
    renamed.attention.layer_types = {"near": saved["attention"]["layer_types"]["local"],
                                     "far": saved["attention"]["layer_types"]["global"]}
    assert differences(renamed) == ([], [])
    # The same types in another order: the pattern, with the first layer that differs.
    reordered = hybrid()
    reordered.attention.pattern = "global,local,local,local,local,local"
    assert differences(reordered) == ([], [
        "attention.pattern: checkpoint 'local,local,local,local,local,global' vs config "
        "'global,local,local,local,local,local' (layer 0's sliding_window: checkpoint 128 vs config None)"])
    # A type's RoPE: its theta refused, scaling added to a type that had none listed (an extension).
    rope = hybrid(rope_theta=20_000.0, rope_scaling={"type": "linear", "factor": 4.0})
    assert differences(rope) == (
        ["attention.layer_types.local.rope_scaling: checkpoint none vs config linear(factor=4.0)"],
        ["attention.layer_types.local.rope_theta: checkpoint 10000.0 vs config 20000.0"])
    # A uniform model made hybrid.
    uniform = base.get_config("tiny")
    uniform.model.num_layers = 6
    assert differences_from(uniform.to_dict(), hybrid()) == [
        "attention.pattern: checkpoint '' vs config 'local,local,local,local,local,global' (layer 0's "
        "sliding_window: checkpoint None vs config 128)"]
    # attention.* itself is its own key, not each type's.
    windowed = hybrid()
    windowed.attention.chunk_size = 256
    assert differences(windowed)[1] == ["attention.chunk_size: checkpoint None vs config 256"]


def differences_from(saved: dict, config) -> list[str]:
    return compat.init_from_differences(saved, config.to_dict(), ())[1]


def test_a_layer_types_sinks_are_a_shape():
    saved = hybrid().to_dict()
    config = hybrid(attention_sinks=True)
    error = compat.model_shape_error(config, "x", saved)
    assert error and "attention.layer_types.local.attention_sinks: checkpoint False vs config True." in str(error)
    assert compat.model_shape_error(hybrid(), "x", saved) is None
