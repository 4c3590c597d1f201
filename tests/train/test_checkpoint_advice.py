"""The advice a model-shape mismatch gives fits the case: resuming a workdir, or starting from
another run's parameters with checkpoint.init_from (whose user is already using init_from, and
whose checkpoint of another shape no init_from could take). Checked on the small checkpoint of
tests/fixtures/ (d_model 32) against the tiny preset (d_model 128): the Checkpointer refuses it
before anything is compiled."""

import os
import re
import shutil

import pytest

from configs import base
from longctx.errors import ConfigError
from longctx.train import checkpoint as checkpoint_lib
from tests import FIXTURES

SAVED = os.path.join(FIXTURES, "checkpoint_2373a90")


def refusal(workdir: str, init_from: str = "") -> str:
    config = base.get_config("tiny")
    config.checkpoint.init_from = init_from
    with pytest.raises(ConfigError) as e:
        checkpoint_lib.Checkpointer(workdir, config)
    return str(e.value)


def test_init_from_of_another_shape_advises_setting_the_shape_or_another_checkpoint(tmp_path):
    message = refusal(str(tmp_path / "new"), init_from=SAVED)
    assert re.match(rf"^the model in checkpoint\.init_from='{re.escape(SAVED)}' \(step 2\) differs from this "
                    r"config: .*model\.d_model: checkpoint 32 vs config 128", message), message
    assert message.endswith(". Set these as the checkpoint has them (a converted model's config_overrides.txt "
                            "lists its flags), or start from a checkpoint of this model's shape."), message
    assert "new workdir" not in message and "or checkpoint.init_from" not in message


def test_resuming_another_shape_advises_setting_the_shape_or_a_new_workdir(tmp_path):
    workdir = shutil.copytree(SAVED, str(tmp_path / "run"))
    message = refusal(workdir)
    assert "model.d_model: checkpoint 32 vs config 128" in message, message
    assert message.endswith(". Set these as the checkpoint has them to resume it, or use a new workdir for "
                            "this model."), message
    assert "init_from" not in message  # (its parameters fit no model of this shape either)
