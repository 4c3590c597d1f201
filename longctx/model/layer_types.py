"""Layer types: a model is a period of named layer types repeated over its depth (hybrid attention).

`attention.pattern` names the types of one period in order, e.g. "local,local,local,local,local,global"
(Gemma 3), and `attention.layer_types.<name>` holds what each type sets:

  mask      sliding_window, chunk_size, attention_sinks, logits_soft_cap
  strategy  cp, cp_ulysses, block_size
  RoPE      rope (False: no rotary embedding, "NoPE"), rope_theta, rope_scaling
  scale     temperature_floor, temperature_scale: Llama 4's position-dependent query scale for
            its NoPE layers ("temperature tuning"), q * (1 + temperature_scale *
            log(1 + floor((position + 1) / temperature_floor))), position in the document

A key a type leaves out takes its `attention.*` value (RoPE: `model.rope_theta` and
`model.rope_scaling`), so a type is only what sets it apart; a key set to None (`sliding_window=None`
on a global type of a model whose attention.sliding_window is set) unsets it. Layer i has the type
pattern[i % period]; where model.num_layers is not a multiple of the period, the last layers are
the first types of one more period (Gemma 3 27B: 62 = 10 x 6 + 2). An empty pattern is one type,
`attention.*` itself, for every layer: every config written before layer types means what it meant.

The types are data, read here once. Every layer has the same parameters whatever its type, so the
decoder keeps them in one stack, as for a model without a pattern, and scans one layer body over
the depth with each layer's type index beside its parameters (`layer_type_indices`): the body
branches (`by_type`, one `lax.switch` branch per distinct RoPE and per distinct attention) only
where types differ, and the projections, the MLP, the norms and their backward are compiled
once whatever the pattern, its period or its remainder. Nothing outside this module branches on
a type's name.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np

from longctx.errors import ConfigError
from longctx.model import rope as rope_lib

# The attention keys a type may set (the rest of attention.* is one for every layer: the layout,
# the kernel, document masking and the residual policy are properties of the whole step).
ATTENTION_KEYS = ("sliding_window", "chunk_size", "attention_sinks", "logits_soft_cap", "cp",
                  "cp_ulysses", "block_size")
ROPE_KEYS = ("rope", "rope_theta", "rope_scaling")
TEMPERATURE_KEYS = ("temperature_floor", "temperature_scale")
TYPE_KEYS = ATTENTION_KEYS + ROPE_KEYS + TEMPERATURE_KEYS
# The name of the one type of a model without a pattern.
UNIFORM = "default"


@dataclasses.dataclass(frozen=True)
class LayerType:
    """One layer type, resolved: `attention` is config.attention with the type's keys applied (what
    the attention layer and the ring read), `rotary` its RoPE (None: no rotary embedding),
    `temperature` its (floor, scale) of the query scale (None: none)."""

    name: str
    attention: ml_collections.ConfigDict
    rotary: rope_lib.Rotary | None
    temperature: tuple[int, float] | None = None


def pattern(attention_config) -> tuple[str, ...]:
    """The type names of one period, in order; (UNIFORM,) without a pattern. An empty entry
    (`local,,global`) is one sentence."""
    text = attention_config.get("pattern") or ""
    if not text.strip():
        return (UNIFORM,)
    names = tuple(name.strip() for name in text.split(","))
    if "" in names:
        named = [name for name in names if name]
        raise ConfigError(f"attention.pattern={text!r} has an empty entry (position {names.index('') + 1}): "
                          f"name a layer type at every position, e.g. {','.join(named) or 'local,global'}.")
    return names


def is_hybrid(config) -> bool:
    return pattern(config.attention) != (UNIFORM,)


def depth_split(num_layers: int, period: int) -> tuple[int, int]:
    """(whole periods, remainder layers): the decoder scans the first, then runs the remainder's
    layers, which are the first `remainder` types of the pattern."""
    return num_layers // period, num_layers % period


def layer_counts(num_layers: int, period: int) -> tuple[int, ...]:
    """How many layers each position of the period has."""
    whole, remainder = depth_split(num_layers, period)
    return tuple(whole + (position < remainder) for position in range(period))


def type_of_layer(config, layer: int) -> str:
    names = pattern(config.attention)
    return names[layer % len(names)]


def _type_settings(config, name: str) -> dict:
    """The keys type `name` sets (empty for UNIFORM); one sentence for an unknown name or key."""
    if name == UNIFORM:
        return {}
    types = config.attention.get("layer_types") or {}
    if name not in types:
        defined = ", ".join(sorted(types)) or "none"
        raise ConfigError(f"attention.pattern names layer type {name!r}, which attention.layer_types does "
                          f"not define (defined: {defined}): add attention.layer_types.{name} or fix the "
                          "pattern.")
    settings = dict(types[name])
    unknown = sorted(set(settings) - set(TYPE_KEYS))
    if unknown:
        raise ConfigError(f"attention.layer_types.{name}.{unknown[0]} is not a key a layer type sets; "
                          f"the keys are {', '.join(TYPE_KEYS)}.")
    return settings


def resolve(config, name: str) -> LayerType:
    """Type `name` of `config` with every key it leaves out taken from attention.* / model.*."""
    settings = _type_settings(config, name)
    attention = ml_collections.ConfigDict(config.attention.to_dict())
    for key in ("pattern", "layer_types"):
        if key in attention:
            del attention[key]
    for key in ATTENTION_KEYS:
        if key in settings:
            attention[key] = settings[key]
    m = config.model
    rotary = None
    if settings.get("rope", True):
        rotary = rope_lib.rotary(m.head_dim, settings.get("rope_theta", m.rope_theta),
                                 rope_scaling(config, name))
    temperature = None
    if settings.get("temperature_floor") is not None:
        temperature = (int(settings["temperature_floor"]), float(settings.get("temperature_scale", 0.1)))
    return LayerType(name, attention, rotary, temperature)


def rope_scaling(config, name: str) -> dict | None:
    """Type `name`'s RoPE scaling (model.rope_scaling's keys, with those the type's rope_scaling
    sets over them: `rope_scaling=dict(type="linear", factor=8.0)` needs no other key)."""
    scaling = config.model.get("rope_scaling")
    merged = None if scaling is None else dict(scaling)
    own = _type_settings(config, name).get("rope_scaling")
    if own is not None:
        merged = {**(merged or {}), **dict(own)}
    return merged


def period(config) -> tuple[LayerType, ...]:
    """The resolved types of one period, in pattern order (one LayerType per position)."""
    names = pattern(config.attention)
    resolved = {name: resolve(config, name) for name in dict.fromkeys(names)}  # each type once
    return tuple(resolved[name] for name in names)


def distinct(config) -> tuple[LayerType, ...]:
    """The model's types, each once, in the order its pattern first names them."""
    first = {}
    for layer_type in period(config):
        first.setdefault(layer_type.name, layer_type)
    return tuple(first.values())


def layer_type_indices(config) -> np.ndarray:
    """int32 [model.num_layers]: each layer's type, as an index into `distinct(config)`."""
    names = [t.name for t in distinct(config)]
    return np.array([names.index(type_of_layer(config, layer)) for layer in range(config.model.num_layers)],
                    np.int32)


def any_sinks(config) -> bool:
    """Whether some type has attention sinks: then every layer has a sinks parameter (the layers'
    parameters are one stack), which the layers of a type without sinks do not read."""
    return any(t.attention.attention_sinks for t in distinct(config))


def branches(items, key) -> tuple[list, np.ndarray]:
    """(the distinct values of key(item) over `items`, each as its first item, in order; int32
    [len(items)]: the index of each item's value). The decoder compiles one branch per distinct
    value: types that differ only in their mask share the projections' branch, and types that
    differ only in RoPE the attention's."""
    values, keys, index = [], [], []
    for item in items:
        k = key(item)
        if k not in keys:
            keys.append(k)
            values.append(item)
        index.append(keys.index(k))
    return values, np.array(index, np.int32)


def branch_of(branch_of_type: np.ndarray, type_index):
    """The branch of a layer of type `type_index`: a host int for a host index (an unrolled layer),
    else looked up on device (the layer scan's traced index)."""
    if isinstance(type_index, (int, np.integer)):
        return int(branch_of_type[type_index])
    return jax.numpy.asarray(branch_of_type)[type_index]


def attention_key(attention_config) -> str:
    """What decides a type's attention branch: its whole attention config, by value."""
    return repr(sorted(attention_config.to_dict().items()))


def by_type(which, functions, *operands):
    """functions[which](*operands): called directly when there is one function or `which` is a host
    integer (an unrolled layer), else under `lax.switch`, which compiles each function once and
    runs the one `which` (traced: the layer scan's type index) names."""
    if len(functions) == 1:
        return functions[0](*operands)
    if isinstance(which, (int, np.integer)):
        return functions[int(which)](*operands)
    return jax.lax.switch(which, functions, *operands)


def whole_row_notes(config) -> list[str]:
    """One line for each type whose window or chunk reaches every key of a data.seq_len-token row:
    its layers attend as a global layer does (a global layer in disguise), which the config does
    not say outright; said once at start-up."""
    seq_len, notes = config.data.seq_len, []
    for layer_type in distinct(config):
        a, prefix = layer_type.attention, type_prefix(layer_type.name)
        window, chunk = a.get("sliding_window"), a.get("chunk_size")
        if window is not None and window >= seq_len - 1:
            notes.append(f"{prefix}sliding_window={window} reaches every earlier key of the {seq_len:,}-token "
                         f"rows (data.seq_len), so its layers are global layers in disguise: set it below "
                         f"{seq_len - 1} for local ones, or unset it.")
        if chunk is not None and chunk >= seq_len:
            notes.append(f"{prefix}chunk_size={chunk} holds the whole {seq_len:,}-token rows (data.seq_len) "
                         f"in one chunk, so its layers are global layers in disguise: set it below {seq_len} "
                         "for chunked ones, or unset it.")
    return notes


def set_type_key(config, name: str, key: str, value) -> None:
    """Sets type `name`'s `key` (one of TYPE_KEYS) in `config`, defining the type where the config
    does not: a type holds only what sets it apart, so a key it does not set yet is still its own."""
    with config.unlocked():
        types = config.attention.layer_types
        if name not in types:
            types[name] = {}
        types[name][key] = value


def type_prefix(name: str) -> str:
    """The config path errors name for a key of type `name` (attention.* for the uniform type)."""
    return "attention." if name == UNIFORM else f"attention.layer_types.{name}."
