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
