"""When no candidate of a plan fits (plan/fit_remedy.py): the nearest slice, sequence or batch that
does, each the first that the memory model fits, and scripts/plan.py's exit 2 with it."""

import copy
import os
import sys

from configs import base
from longctx.plan import fit_remedy, hardware, planner
from tests import child_env
from tests.validate_commands import ScriptServer


def _config(preset, **data):
    c = copy.deepcopy(base.get_config(preset))
    c.unlock()
    c.data.update(**data)
    c.lock()
    return c


def _fits(config, topology):
    need = planner.smallest_memory(config, topology)
    return need is not None and need <= planner.HBM_HEADROOM * topology.chip.hbm_bytes


def test_slices_double_their_shortest_axis_up_to_the_largest_of_the_chip():
    names = [t.name for t in fit_remedy.larger_slices(hardware.parse_topology("v5e:2x2"))]
    assert names == ["v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16"]
    assert [t.name for t in fit_remedy.larger_slices(hardware.parse_topology("v5p:4x4x4"))][:2] == [
        "v5p:4x4x8", "v5p:4x8x8"]


def test_the_smallest_slice_is_the_first_that_fits():
    """The 8B preset (4 x 131,072 tokens) needs ~101 GiB per v5e chip on 4 chips: 64 fit, 32 do not."""
    c = _config("llama3_8b_128k")
    slice_ = fit_remedy.smallest_slice(c, hardware.parse_topology("v5e:2x2"))
    assert slice_.name == "v5e:8x8"
    assert _fits(c, slice_) and not _fits(c, hardware.parse_topology("v5e:4x8"))
    assert fit_remedy.longest_seq_len(c, hardware.parse_topology("v5e:2x2")) is None  # the weights alone


def test_the_longest_sequence_is_the_first_that_fits():
    c = _config("llama3_8b_128k", seq_len=2_097_152, global_batch_size=1)
    v5p = hardware.parse_topology("v5p:2x2x2")
    longest = fit_remedy.longest_seq_len(c, v5p)
    assert longest == 524_288
    assert _fits(_config("llama3_8b_128k", seq_len=longest, global_batch_size=1), v5p)
    assert not _fits(_config("llama3_8b_128k", seq_len=2 * longest, global_batch_size=1), v5p)


def test_plan_that_nothing_fits_exits_2_with_the_nearest_slice():
    """Not the table and `run #1: ...` (a run that does not fit) with exit status 0."""
    result = ScriptServer.run([sys.executable, os.path.join(child_env.ROOT, "scripts", "plan.py"),
                               "--config=configs/base.py:llama3_8b_128k", "--topology=v5e:2x2", "--compile", "0"],
                              cwd=child_env.ROOT, env=child_env.script_env(), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("longctx: ")]
    assert lines == ["longctx: no candidate fits v5e:2x2 by the memory model: the smallest needs ~101 GiB "
                     "per device of 16; --topology=v5e:8x8 (64 chips) is the smallest v5e slice that fits "
                     "4 x 131,072 tokens."], result.stderr[-2000:]
    assert "run #" not in result.stdout


def test_fewer_sequences_where_no_slice_of_the_chip_fits():
    """The 70B preset (32 x 131,072 tokens) fits no v5e slice, up to the largest (16x16); four
    sequences per step fit there, eight do not."""
    c, largest = _config("llama3_70b_128k"), hardware.parse_topology("v5e:16x16")
    assert not _fits(c, largest)
    assert fit_remedy.largest_batch(c, largest) == 4
    assert not _fits(_config("llama3_70b_128k", global_batch_size=8), largest)
