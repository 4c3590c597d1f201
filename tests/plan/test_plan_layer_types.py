"""The planner on a hybrid model (attention.pattern): the step priced per layer type (its mask,
block and strategy, times its layer count), a strategy chosen per type, the layout one for the
whole step, and plan.py's table showing the per-type choice."""

import copy
import itertools

import pytest

from configs import base
from longctx import config as config_lib
from longctx.plan import auto, collectives, hardware, planner, step_time

V5P_64 = hardware.parse_topology("v5p:4x4x4")


def _config(preset, **attention):
    c = copy.deepcopy(base.get_config(preset))
    c.unlock()
    c.attention.update(**attention)
    c.lock()
    return c


def _type_seconds(row, name: str) -> float:
    """What one layer type adds to the step: its attention, and what its collectives and its
    layers' FSDP traffic leave exposed."""
    t = row.step.per_type[name]
    return t["attention_seconds"] + t["cp_exposed_seconds"] + t["fsdp_exposed_seconds"]


def _priced(config, mesh, strategy, layout, block):
    """A candidate priced as the planner prices it (each type's own schedule)."""
    cc = planner.candidate_config(config, mesh, strategy, layout, config.attention.residuals,
                                  config.model.remat_policy, block)
    config_lib.validate(cc, num_devices=mesh["dp"] * mesh["fsdp"] * mesh["sp"])
    schedules = planner._type_schedules(cc, None, {}, {})
    return step_time.estimate(cc, V5P_64, schedules, mesh)


def test_gemma3_chooses_the_halo_for_its_window_and_a_ring_strategy_for_its_global_layers():
    """Gemma-3-12B's shape at 131,072 tokens, sp=16: the local type (window 1,024) needs only the
    last 1,024 tokens of its neighbour's shard, so the halo wins it; the global type has no window
    (halo is not offered to it) and takes one of the ring's kind. Against a brute force over every
    per-type combination the heads allow: the planner's first row is the fastest, and each type's
    choice is the one that minimises that type's own part of the step."""
    c = _config("gemma3_12b_128k")
    rows = planner.plan(c, V5P_64, open_keys=("attention.cp",))
    best = rows[0]
    assert isinstance(best.strategy, planner.PerType)
    chosen = best.strategy.by_type()
    assert chosen["local"].name == "halo"
    assert chosen["global"].name != "halo"
    assert best.step.per_type["local"]["layers"] == 40 and best.step.per_type["global"]["layers"] == 8
    assert best.step.per_type["local"]["cp"] == "halo"
    # The step is the sum over types: the per-type parts and the shared ones add up.
    s = best.step
    assert sum(t["attention_seconds"] for t in s.per_type.values()) == pytest.approx(s.attention)
    assert sum(t["cp_exposed_seconds"] for t in s.per_type.values()) == pytest.approx(s.cp_exposed)

    # Brute force: every combination of the strategies each type allows, priced whole.
    mesh, layout, block = best.mesh, best.layout, best.block
    local_options = [planner.Strategy(n) for n in ("ring", "all_gather", "ulysses", "halo")]
    global_options = [planner.Strategy(n) for n in ("ring", "all_gather", "ulysses")]
    groups = best.strategy.types
    priced = {}
    for g, loc in itertools.product(global_options, local_options):
        strategy = planner.PerType(((planner.SHARED, g), ("local", loc)), groups)
        priced[(g.name, loc.name)] = _priced(c, mesh, strategy, layout, block)
    fastest = min(priced, key=lambda k: priced[k].seconds)
    assert best.step.seconds == pytest.approx(priced[fastest].seconds, rel=1e-9)
    assert (chosen["global"].name, chosen["local"].name) == fastest
    # Each type's choice minimises its own part, whatever the other type takes.
    for g in global_options:
        own = {loc.name: priced[(g.name, loc.name)].per_type["local"] for loc in local_options}
        assert min(own, key=lambda n: own[n]["attention_seconds"] + own[n]["cp_exposed_seconds"]
                   + own[n]["fsdp_exposed_seconds"]) == "halo"
    # The halo saves the local layers' communication against the ring's passes of whole shards.
    ring_local = priced[(chosen["global"].name, "ring")]
    assert ring_local.per_type["local"]["cp_exposed_seconds"] > 2 * s.per_type["local"]["cp_exposed_seconds"]


def test_the_halo_s_permutes_are_priced_exposed_as_its_program_runs_them():
    """ops/halo.py stacks every received hull before its one loop of kernel calls and sends the
    dK/dV hulls home after it (tests/ops/test_strategy_overlap.py reads that from the program), so
    its permutes add to the step whole, however long the local layers' blocks: here the blocks
    take longer than the permutes, which a rule hiding them behind the blocks would hide."""
    c = _config("gemma3_12b_128k")
    mesh = {"dp": 1, "fsdp": 4, "sp": 16}
    strategy = planner.PerType(((planner.SHARED, planner.Strategy("all_gather")),
                                ("local", planner.Strategy("halo"))), planner._groups(c))
    s = _priced(c, mesh, strategy, "zigzag", 512)
    local, permutes = s.per_type["local"], s.communication["cp_permute"]  # all-gather sends none
    assert 0 < permutes < local["attention_seconds"]
    assert local["cp_exposed_seconds"] > permutes


def test_a_per_type_row_is_the_config_its_overrides_give():
    """The row's config holds each type's strategy where that type reads it (its own cp, or
    attention.cp), and its command-line overrides say the same."""
    c = _config("gemma3_12b_128k")
    best = planner.plan(c, V5P_64, open_keys=("attention.cp",))[0]
    by_type = {t.name: t.attention.cp for t, _ in collectives.type_layers(best.config)}
    assert by_type == {t: s.name for t, s in best.strategy.by_type().items()}
    flags = best.overrides()
    assert f"--config.attention.cp={best.strategy.by_type()['global'].name}" in flags
    assert "--config.attention.layer_types.local.cp=halo" in flags
    assert best.as_dict()["cp_per_layer_type"] == {t: str(s) for t, s in best.strategy.by_type().items()}


def test_the_layout_is_one_for_the_whole_step():
    c = _config("tiny_hybrid")
    topology = hardware.parse_topology("v5p:2x2x2")
    rows = planner.plan(c, topology, open_keys=("attention.cp", "attention.layout"))
    for r in rows:
        assert r.config.attention.layout == r.layout
        assert "layout" not in dict(r.config.attention.layer_types["local"])
    assert len({r.layout for r in rows}) == 3


def test_cp_auto_chooses_per_type_and_keeps_a_type_s_own_choice():
    """attention.cp=auto chooses the strategy of the types that take attention.cp and of those that
    set cp=auto themselves; a type that names its own strategy keeps it."""
    devices = [type("Device", (), {"device_kind": "TPU v5", "platform": "tpu", "coords": (x, y, z)})()
               for x in range(4) for y in range(4) for z in range(4)]
    c = _config("gemma3_12b_128k", cp="auto")
    c.unlock()
    c.attention.layer_types.local.cp = "ring"  # the user's own
    c.lock()
    kept = auto.resolve(c, devices)
    assert kept.config.attention.layer_types.local.cp == "ring"
    assert {str(s) for t, s in kept.chosen.strategy.by_type().items() if t == "local"} == {"ring"}
    c.unlock()
    c.attention.layer_types.local.cp = "auto"
    c.lock()
    assert planner.auto_keys(c)[0] == "attention.cp"
    chosen = auto.resolve(c, devices)
    assert chosen.config.attention.layer_types.local.cp == "halo"
    assert chosen.chosen.step.seconds < kept.chosen.step.seconds
    assert "local halo" in auto.describe(chosen)
