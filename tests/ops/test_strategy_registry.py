"""A context-parallel strategy is one object (ops/strategy.py), registered once
(ops/context_parallel.REGISTRY): one that lacks a method or a planner attribute cannot be made or
registered, and a name the registry does not hold has no price anywhere (no fall-through to the
ring's)."""
import copy

import pytest

from configs import base
from longctx.ops import context_parallel, strategy
from longctx.plan import collectives, memory_model


def _methods():
    return {name for name in dir(strategy.Strategy)
            if getattr(getattr(strategy.Strategy, name), "__isabstractmethod__", False)}


def _lacking(method: str):
    """A strategy class with every abstract method but `method` (each one a stub: never called)."""
    body = {name: (lambda *args, **kwargs: None) for name in _methods() - {method}}
    body.update(name="lacking", simplicity=9)
    return type("Lacking", (strategy.Strategy,), body)


def test_the_interface_is_what_it_runs_its_schedule_and_its_price():
    assert _methods() == {"candidates", "config_problem", "check", "forward", "backward",
                          "from_step_blocks", "dead_grid_steps", "steps_in_words", "transfers",
                          "kernel_calls", "working_bytes"}


@pytest.mark.parametrize("method", sorted(_methods()))
def test_a_strategy_without_a_method_cannot_be_made(method):
    with pytest.raises(TypeError, match=method):
        _lacking(method)()
    _lacking("nothing")()  # with all of them it can


def test_a_strategy_without_a_planner_attribute_is_not_registered():
    cls = _lacking("nothing")
    del cls.simplicity
    with pytest.raises(TypeError, match="does not set simplicity"):
        context_parallel._complete(cls)


def test_every_registered_strategy_is_one_module_s_class_with_every_method():
    modules = {cls.__module__ for cls in context_parallel.REGISTRY.values()}
    assert len(modules) == len(context_parallel.REGISTRY) == 5
    for name, cls in context_parallel.REGISTRY.items():
        assert cls.name == name and not getattr(cls, "__abstractmethods__", None), name
    made = context_parallel.candidates(heads=8, sp=8)
    assert [str(s) for s in made] == ["ring", "all_gather", "ulysses", "usp x2", "usp x4", "halo"]
    assert context_parallel.named("usp", 4) == made[4] and context_parallel.named("ring") == made[0]


def test_an_unknown_strategy_has_no_price():
    """The memory model, the closed-form bytes and the model's own keywords refuse a strategy the
    registry does not hold, rather than pricing it as the ring."""
    config = copy.deepcopy(base.get_config("tiny"))
    config.attention.cp = "ring_of_rings"
    mesh = {"dp": 1, "fsdp": 2, "sp": 4}
    with pytest.raises(ValueError, match="ring_of_rings"):
        memory_model.per_device_bytes(config, mesh)
    shape = collectives.Shape(batch=1, seq_len=1024, sp=4, heads=4, kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match="ring_of_rings"):
        collectives.formula("ring_of_rings", shape)
    with pytest.raises(ValueError, match="ulysses_degree=2 is only for strategy='usp', not 'ring'"):
        context_parallel.named("ring", 2)
