"""Does a saved checkpoint fit this run? The comparisons behind every resume decision.

A checkpoint that reads fine can still belong to another run. Three questions, each answered from
the small parts of a step (its config JSON and its arrays' shapes), before any array is read:
  - model shape: the config keys that fix parameter shapes differ -> an error (`ConfigError`);
  - train-state structure: the arrays themselves differ (e.g. another optimizer chain) -> an error
    listing them;
  - data stream: the keys that define the training stream differ -> the saved iterator state
    means nothing, and the data restarts (the caller decides how).
Other differences are only reported.
"""

from __future__ import annotations

import jax
import numpy as np

from longctx import rope
from longctx.errors import ConfigError

# Config keys that fix the shapes (or presence) of parameters: a difference is an error on resume.
SHAPE_KEYS = tuple(f"model.{k}" for k in (
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "tie_embeddings", "param_dtype")) + ("attention.attention_sinks",)
# Data keys that define the training stream: if one differs, the saved iterator state means nothing.
STREAM_KEYS = tuple(f"data.{k}" for k in (
    "path", "seq_len", "global_batch_size", "packer", "shuffle_seed", "num_workers"))
_MAX_LISTED = 12
_NEW_WORKDIR = "Use a new workdir, or checkpoint.init_from to start from its parameters."


def _get(config: dict, dotted: str):
    section, key = dotted.split(".", 1)
    return (config.get(section) or {}).get(key)


def config_differences(saved: dict, current: dict, keys) -> list[str]:
    """`"key: checkpoint X vs config Y"` for each dotted key whose value differs."""
    return [f"{k}: checkpoint {_get(saved, k)!r} vs config {_get(current, k)!r}"
            for k in keys if _get(saved, k) != _get(current, k)]


def section_differences(saved: dict, current: dict, section: str, skip=()) -> list[str]:
    """Every differing key of one config section, except those in `skip`."""
    keys = sorted(set(saved.get(section) or {}) | set(current.get(section) or {}))
    return config_differences(saved, current, [f"{section}.{k}" for k in keys
                                                if f"{section}.{k}" not in skip])


def flat_arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{"params/embed/value": (shape, dtype)}` for a tree of arrays, ShapeDtypeStructs or Orbax
    ArrayMetadata (dataclass fields, dict keys and named-tuple fields all give plain names)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/").replace("/.", "/"):
            (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in leaves}


def structure_differences(saved: dict, current: dict) -> list[str]:
    """The arrays (from `flat_arrays`) that only one side has or that differ, at most a dozen."""
    out = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            out.append(f"{name} only in the checkpoint")
        elif name not in saved:
            out.append(f"{name} only in this run")
        elif saved[name] != current[name]:
            (s_shape, s_dtype), (c_shape, c_dtype) = saved[name], current[name]
            out.append(f"{name}: checkpoint {s_dtype}{list(s_shape)} vs this run {c_dtype}{list(c_shape)}")
    if len(out) > _MAX_LISTED:
        out = out[:_MAX_LISTED] + [f"... and {len(out) - _MAX_LISTED} more"]
    return out


def model_shape_error(config, where: str, saved_config: dict) -> ConfigError | None:
    """The error for a checkpoint whose model shape differs from `config`'s, or None."""
    diffs = config_differences(saved_config, config.to_dict(), SHAPE_KEYS)
    if not diffs:
        return None
    return ConfigError(f"the model in {where} differs from this config: " + "; ".join(diffs)
                       + f". {_NEW_WORKDIR}")


def check_fits(config, where: str, saved_config: dict, saved_arrays: dict, target) -> None:
    """Raises ConfigError when a readable step is not this run's: another model shape, or another
    train-state structure (`target` is this run's abstract state)."""
    error = model_shape_error(config, where, saved_config)
    if error:
        raise error
    diffs = structure_differences(saved_arrays, flat_arrays(target))
    if diffs:
        raise ConfigError(f"the train state in {where} does not fit this run's (optimizer or model "
                          f"settings changed?): " + "; ".join(diffs) + f". {_NEW_WORKDIR}")


# ----------------------------------------------------------------------------- init_from

# Config keys that, besides the shapes, define the function a model's parameters compute: a run
# started (checkpoint.init_from) from parameters trained with other values trains another
# function, e.g. a converted Llama read with the wrong rope_theta or without its window. A
# difference is refused unless checkpoint.init_from_allow names the key. (model.rope_scaling is
# one key: its type and the values that type reads.)
INIT_FROM_KEYS = ("model.rope_theta", "model.rope_scaling", "model.norm_eps", "model.final_logits_soft_cap",
                  "attention.causal", "attention.sliding_window", "attention.chunk_size",
                  "attention.logits_soft_cap")
# Changed on purpose by context extension (README "Extend a released model"): listed, never refused.
_EXTENSION_KEYS = ("data.seq_len",)


def _rope_scaling(config: dict) -> str:
    """'none', or 'llama3(factor=8.0, ...)': the type and only the values it reads."""
    scaling = (config.get("model") or {}).get("rope_scaling") or {"type": "none"}
    kind = scaling.get("type", "none")
    values = ", ".join(f"{k}={scaling.get(k)!r}" for k in rope.KEYS_BY_TYPE.get(kind, ()) if scaling.get(k) is not None)
    return f"{kind}({values})" if values else kind


def init_from_differences(saved: dict, current: dict, allowed) -> tuple[list[str], list[str]]:
    """(changes to list, changes to refuse) between init_from's saved config and this run's.

    Listed: the context-extension changes (data.seq_len; RoPE scaling added to a model that had
    none) and the differences `allowed` names. Refused: every other INIT_FROM_KEYS difference."""
    listed, refused = config_differences(saved, current, _EXTENSION_KEYS), []
    for key in INIT_FROM_KEYS:
        if key == "model.rope_scaling":
            before, after = _rope_scaling(saved), _rope_scaling(current)
            if before == after:
                continue
            text = f"{key}: checkpoint {before} vs config {after}"
            extension = before == "none"
        else:
            (text,) = config_differences(saved, current, [key]) or (None,)
            if text is None:
                continue
            extension = False
        (listed if extension or key in allowed else refused).append(text)
    return listed, refused


def init_from_allowed(config) -> tuple[str, ...]:
    """The keys of `checkpoint.init_from_allow` ("key,key"; absent from older configs)."""
    text = config.checkpoint.get("init_from_allow") or ""
    return tuple(k.strip() for k in text.split(",") if k.strip())
