"""The presets agree with themselves: none draws a start-up note about its own settings."""

import numpy as np
import pytest

from configs import base
from longctx.train import optimizer


@pytest.mark.parametrize("preset", sorted(base.PRESETS))
def test_no_preset_has_a_warmup_longer_than_its_run(preset):
    """long_cpu (4 steps) inherited tiny's 10 warmup steps, and every run of it began with a note
    that the warmup was cut to the run."""
    config = base.get_config(preset)
    notes = optimizer.optimizer_notes(config)
    assert not [note for note in notes if "warmup_steps" in note], notes


def test_long_cpu_learning_rates_are_what_they_were():
    """Its warmup now says what the schedule did with tiny's 10 steps: the same rate at every
    update, so the figures measured with it (docs/long_context.md) still hold."""
    config = base.get_config("long_cpu")
    before = base.get_config("long_cpu")
    before.unlock()
    before.optimizer.warmup_steps = 10
    updates = np.arange(config.train.num_steps + 1)
    np.testing.assert_array_equal(optimizer.learning_rate_schedule(config)(updates),
                                  optimizer.learning_rate_schedule(before)(updates))
