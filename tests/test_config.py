"""Every validation rule fires with a sentence that names its key, before anything compiles."""

import sys

import pytest

from configs import base
from longctx.config import ConfigError, validate
from tests.validate_commands import ScriptServer


def tiny():
    c = base.get_config("tiny")
    c.unlock()
    return c


def test_presets_validate():
    assert validate(base.get_config("tiny"), num_devices=8) == {"dp": 1, "fsdp": 2, "sp": 4}
    assert validate(base.get_config("long_cpu"), num_devices=8)["sp"] == 8
    sizes = validate(base.get_config("llama3_8b_128k"), num_devices=64)
    assert sizes == {"dp": 1, "fsdp": 4, "sp": 16}
    assert validate(base.get_config("llama3_70b_128k"), num_devices=512) == {"dp": 1, "fsdp": 32, "sp": 16}


@pytest.mark.parametrize(
    "overrides, num_devices, message",
    [
        ({"mesh.dp": 3}, 8, "dp*fsdp*sp = 3*2*4 = 24 does not match the 8 devices"),
        ({"mesh.dp": -1, "mesh.fsdp": -1}, 8, "at most one axis may be -1"),
        ({"mesh.fsdp": -1, "mesh.sp": 3}, 8, "not divisible by the fixed axes"),
        ({"mesh.dcn_dp": 3}, 8, "cannot be split into 3 slices"),
        ({"model.num_heads": 6, "model.num_kv_heads": 4}, 8, "model.num_heads=6 is not divisible by model.num_kv_heads=4"),
        ({"model.head_dim": 33}, 8, "model.head_dim=33 must be even"),
        ({"model.d_model": 132}, 8, "model.d_model=132 is not divisible by fsdp*sp = 2*4 = 8, the number of ways the parameters are split"),
        ({"mesh.dp": 2, "mesh.fsdp": 1, "optimizer.shard_state_over_dp": True, "model.d_model": 132}, 8,
         "model.d_model=132 is not divisible by dp*fsdp*sp = 2*1*4 = 8, the number of ways the optimizer state is split"),
        ({"data.seq_len": 2050}, 8, "data.seq_len=2050 is not divisible by 4"),
        ({"data.seq_len": 2048 + 512, "attention.block_size": 256}, 8, "attention.block_size=256 does not divide"),
        ({"attention.layout": "zigzag", "data.seq_len": 4 * 128 * 3 + 4}, 8, "not divisible by 8 (2*sp for the zigzag layout)"),
        ({"train.loss_chunk_size": 384}, 8, "train.loss_chunk_size=384 does not divide"),
        ({"data.global_batch_size": 3}, 8, "data.global_batch_size=3 is not divisible by dp*fsdp = 1*2 = 2"),
        ({"attention.impl": "flash"}, 8, "attention.impl='flash' is not one of"),
        ({"attention.layout": "spiral"}, 8, "attention.layout='spiral' is not one of"),
        ({"data.packer": "greedy"}, 8, "data.packer='greedy' is not one of"),
        ({"model.remat_policy": "everything"}, 8, "model.remat_policy='everything' is not one of"),
        ({"attention.sliding_window": -4}, 8, "attention.sliding_window=-4 must be positive"),
        ({"attention.chunk_size": 0}, 8, "attention.chunk_size=0 must be positive"),
        ({"attention.chunk_size": 256, "attention.causal": False}, 8, "needs attention.causal=True"),
        ({"attention.logits_soft_cap": -1.0}, 8, "attention.logits_soft_cap=-1.0 must be positive"),
        ({"attention.cp": "spiral"}, 8, "attention.cp='spiral' is not one of"),
        ({"attention.cp": "ulysses", "model.num_heads": 6, "model.num_kv_heads": 2}, 8,
         "model.num_heads=6 is not divisible by sp=4: use attention.cp=usp with attention.cp_ulysses in {2}"),
        ({"attention.cp": "usp"}, 8, "attention.cp=usp needs attention.cp_ulysses (now None) dividing both sp=4"),
        ({"attention.cp": "usp", "attention.cp_ulysses": 3}, 8, "set attention.cp_ulysses to one of {2, 4}"),
        ({"attention.cp_ulysses": 2}, 8, "not of attention.cp=ring: unset it or set attention.cp=usp"),
        ({"model.num_layers": 0}, 8, "model.num_layers=0 must be positive"),
        ({"optimizer.min_learning_rate_ratio": 2.0}, 8, "must be in [0, 1]"),
        ({"checkpoint.max_to_keep": 0}, 8, "checkpoint.max_to_keep=0 must be at least 1"),
        ({"train.eval_steps": 0}, 8, "train.eval_steps=0 must be positive"),
    ],
)
def test_rule_fires_with_its_message(overrides, num_devices, message):
    c = tiny()
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    with pytest.raises(ConfigError) as err:
        validate(c, num_devices=num_devices)
    assert message in str(err.value)
    assert "\n" not in str(err.value)  # one sentence, one line


def test_unknown_override_key_fails_on_the_command_line(tmp_path):
    """An unknown key is refused by the locked config, before any jax work."""
    result = ScriptServer.run(
        [sys.executable, "scripts/train.py", "--config=configs/base.py:tiny", f"--workdir={tmp_path}",
         "--config.model.num_layerz=4"],
        timeout=120)
    assert result.returncode != 0
    assert "num_layerz" in result.stderr


def test_bad_mesh_fails_before_compilation(tmp_path):
    result = ScriptServer.run(
        [sys.executable, "scripts/train.py", "--config=configs/base.py:tiny", f"--workdir={tmp_path}",
         "--config.mesh.sp=3"],
        timeout=120)
    assert result.returncode != 0
    assert "longctx: mesh:" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_unwritable_workdir_fails_before_compilation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = ScriptServer.run(
        [sys.executable, "scripts/train.py", "--config=configs/base.py:tiny", f"--workdir={blocker}/run"],
        timeout=120)
    assert result.returncode != 0
    assert "is not writable" in result.stderr
