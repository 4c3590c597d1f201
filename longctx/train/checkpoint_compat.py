"""Does a saved checkpoint fit this run? The comparisons behind every resume decision.

A checkpoint that reads fine can still belong to another run. Three questions, each answered from
the small parts of a step (its config JSON and its arrays' shapes), before any array is read:
  - model shape: the config keys that fix parameter shapes differ -> an error (`ConfigError`); on
    resume also the block options that add no parameters (norm_plus_one, mlp_activation, ...): a
    resumed run is the same model, and Gemma's (1 + w) gains read as plain ones are another; an
    attention that computes otherwise (a mask key, the pattern, a layer type's mask or RoPE)
    trains on, with one line saying so and how to keep the checkpoint's (`attention_notice`);
  - train-state structure: the arrays themselves differ (e.g. another optimizer chain) -> an error
    listing them;
  - data stream: the process count, the keys that define the training stream, the process ->
    data shard map, the dataset's fingerprint or the values of the keys the packer's rows depend
    on differ -> the saved iterator state means nothing, and the data restarts (the caller
    decides how; `data_state_mismatch` says why).
Other differences are only reported. A key absent from a config saved before it existed reads
as its default (`ABSENT_MEANS`), so every older checkpoint compares as the model it is. A
mixture (data.sources) resumes source by source: `mixture_notice` says which sources changed and
restart, and which continue.
"""

from __future__ import annotations

import jax
import numpy as np

from longctx import config as config_lib
from longctx.data import packing
from longctx.errors import ConfigError
from longctx.model import block_options, layer_types, rope

# Config keys that fix the shapes (or presence) of parameters: a difference is an error on resume.
# (A layer type's attention_sinks too: `layer_type_differences`.)
SHAPE_KEYS = tuple(f"model.{k}" for k in (
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
    "tie_embeddings", "param_dtype", "qk_norm", "qkv_bias", "norm_position")) + ("attention.attention_sinks",)
# The block options that add no parameters: what the same parameters compute. Refused on resume;
# on init_from they are config.INIT_FROM_KEYS (refused unless checkpoint.init_from_allow names them).
BLOCK_KEYS = tuple(f"model.{k}" for k in block_options.DEFAULTS if f"model.{k}" not in SHAPE_KEYS)
# What a key reads as in a config saved before the key existed: the value that means what the
# code meant then (Llama's block, one layer type).
ABSENT_MEANS = {**{f"model.{k}": v for k, v in block_options.DEFAULTS.items()},
                "attention.pattern": "", "attention.layer_types": {}}
# The attention keys that change what the same parameters compute: reported on resume
# (`attention_notice`, with the pattern and the layer types), refused on init_from unless allowed.
RESUME_ATTENTION_KEYS = tuple(k for k in config_lib.INIT_FROM_KEYS
                              if k.startswith("attention.") and k != "attention.pattern")
# Data keys that define the training stream: if one differs, the saved iterator state means nothing.
STREAM_KEYS = tuple(f"data.{k}" for k in (
    "path", "seq_len", "global_batch_size", "packer", "shuffle_seed", "num_workers"))
# The key of the saved metadata that holds the train iterator's `BatchIterator.stream_record()`.
DATA_STREAM = "data_stream"
_MAX_LISTED = 12
_MAX_LISTED_DATA = 3
_NEW_WORKDIR = "Use a new workdir, or checkpoint.init_from to start from its parameters."
# What fits a model of another shape: its parameters fit only that shape, so neither resuming
# nor init_from can take them into this one.
_RESUME_OTHER_SHAPE = "Set these as the checkpoint has them to resume it, or use a new workdir for this model."
_INIT_FROM_OTHER_SHAPE = ("Set these as the checkpoint has them (a converted model's config_overrides.txt lists "
                          "its flags), or start from a checkpoint of this model's shape.")


def _get(config: dict, dotted: str):
    section, key = dotted.split(".", 1)
    values = config.get(section) or {}
    return values[key] if key in values else ABSENT_MEANS.get(dotted)


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


def model_shape_error(config, where: str, saved_config: dict, init_from: bool = False) -> ConfigError | None:
    """The error for a checkpoint whose model shape differs from `config`'s, or None; its advice
    is for resuming the run, or with `init_from` for starting from the checkpoint's parameters."""
    current = config.to_dict()
    diffs = config_differences(saved_config, current, SHAPE_KEYS if init_from else SHAPE_KEYS + BLOCK_KEYS)
    diffs += [text for _, _, text in layer_type_differences(saved_config, current, ("attention_sinks",))]
    if not diffs:
        return None
    return ConfigError(f"the model in {where} differs from this config: " + "; ".join(diffs)
                       + f". {_INIT_FROM_OTHER_SHAPE if init_from else _RESUME_OTHER_SHAPE}")


def attention_notice(saved: dict, current: dict) -> str | None:
    """The start-up line of a resume whose attention computes otherwise than the checkpoint's (the
    parameters fit, so it trains on: the mask keys of attention.*, the pattern and every layer
    type's mask and RoPE, layer by layer as `layer_type_differences` compares them), with the
    flags that train on the checkpoint's model instead; None when they agree."""
    found = [(key, _get(saved, key), text) for key in RESUME_ATTENTION_KEYS
             for text in config_differences(saved, current, [key])]
    for key, before, text in layer_type_differences(saved, current, config_lib.INIT_FROM_TYPE_KEYS):
        found.append((key, _get(saved, key) if key == "attention.pattern" else before, text))
    if not found:
        return None
    by_hand = [key for key, _, _ in found if key.endswith(".rope_scaling")]  # (described, not a value)
    flags = [f"--config.{key}={_flag_value(before)}" for key, before, _ in found if key not in by_hand]
    if not _get(saved, "attention.pattern") and _get(current, "attention.layer_types"):
        flags.append("--config.attention.layer_types={}")  # (a uniform model defines no type)
    fix = " ".join(flags) + (" and " if flags and by_hand else "") + (
        f"set {', '.join(by_hand)} as the checkpoint has {'it' if len(by_hand) == 1 else 'them'}"
        if by_hand else "")
    return (f"resuming with another attention than the checkpoint's (the parameters fit, so it trains on): "
            f"{'; '.join(text for _, _, text in found)}; to train the checkpoint's model on, pass {fix}")


def _flag_value(value) -> str:
    """`value` as a --config flag writes it (strings bare, the rest as Python literals)."""
    return value if isinstance(value, str) else repr(value)


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


def data_state_mismatch(saved_config: dict, saved_metadata: dict, current_config: dict,
                        current_record: dict, process_count: int) -> str | None:
    """Why a saved train-iterator state cannot continue this run's stream (a phrase that follows
    "the data iterator state"), or None when it can.

    Each process's Grain state describes its own share of one particular stream: it continues
    that stream only with the same process count, the same stream keys, the same process -> data
    shard map (else processes that now share one sp group would restore different states and
    feed different rows into one sequence), the same dataset (else the same path holds other
    documents), the same values of the keys the packer's rows depend on (else it re-packs its
    window into other rows: tokens are skipped and repeated) and the same seed offset (else the
    same position is one in another order of the documents)."""
    saved_processes = saved_metadata.get("process_count")
    if saved_processes != process_count:
        return f"was saved by {saved_processes} process(es) and this run has {process_count}"
    diffs = config_differences(saved_config, current_config, STREAM_KEYS)
    if diffs:
        return "belongs to another data stream (" + "; ".join(diffs) + ")"
    saved = saved_metadata.get(DATA_STREAM)
    if not saved:
        return "was saved without a record of its data shards and dataset (an older longctx)"
    diffs = shard_differences(saved.get("shards") or {}, current_record["shards"])
    if diffs:
        return ("was saved under another process -> data shard map (" + _listed(diffs) + ")")
    if ("sources" in saved) != ("sources" in current_record):
        return ("was saved from " + ("a mixture (data.sources) and this run reads one data.path"
                                     if "sources" in saved else
                                     "one data.path and this run mixes data.sources"))
    if "sources" not in current_record:
        diffs = fingerprint_differences(saved.get("dataset") or {}, current_record["dataset"])
        if diffs:
            return "belongs to another dataset (" + _listed(diffs) + ")"
        diffs = packing_differences(*_saved_packing(saved, saved_config, saved_metadata),
                                    current_record.get("packing") or {})
        if diffs:
            return "was packed into rows under other settings (" + _listed(diffs) + ")"
    # (a mixture checks dataset and packing per source: mixture.MixtureIterator.set_state
    # restarts only the sources whose id changed, and mixture_notice says which)
    then, now = saved_seed_offset(saved_metadata), current_record.get("seed_offset", 0)
    if then != now:
        return (f"belongs to the stream shuffled with seed offset {then} (data.shuffle_seed + the "
                f"step it restarted at) and this iterator's offset is {now}")
    return None


def mixture_notice(saved_metadata: dict, current_record: dict) -> str | None:
    """One phrase for a mixture resumed with changed sources (None when nothing changed): the
    weights that changed, the sources added or dropped, and those whose data, packing, filters or
    seed changed, which start at their beginning; every other source continues where it was
    (data/mixture.py documents the behaviour)."""
    saved = (saved_metadata.get(DATA_STREAM) or {}).get("sources")
    current = current_record.get("sources")
    if saved is None or current is None:
        return None
    parts = []
    weights = [f"{n} {saved[n]['weight']:.3g} -> {current[n]['weight']:.3g}"
               for n in sorted(set(saved) & set(current)) if saved[n]["weight"] != current[n]["weight"]]
    if weights:
        parts.append("weights " + ", ".join(weights))
    added, dropped = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if added:
        parts.append("added " + ", ".join(added) + " (from its beginning)")
    if dropped:
        parts.append("dropped " + ", ".join(dropped))
    for name in sorted(set(saved) & set(current)):
        then, now = saved[name], current[name]
        if then.get("id") == now.get("id"):
            continue
        why = (fingerprint_differences(then.get("dataset") or {}, now.get("dataset") or {})
               + packing_differences(then.get("packing") or {}, True, now.get("packing") or {})
               + [f"{k}: {then['selection'].get(k)!r} then vs {v!r} now"
                  for k, v in (now.get("selection") or {}).items()
                  if (then.get("selection") or {}).get(k) != v]
               + ([f"seed {then.get('seed')} then vs {now.get('seed')} now"]
                  if then.get("seed") != now.get("seed") else []))
        parts.append(f"{name} restarts from its beginning ({_listed(why or ['its id'])})")
    if not parts:
        return None
    kept = sorted(n for n in set(saved) & set(current) if saved[n].get("id") == current[n].get("id"))
    return ("the data mixture changed: " + "; ".join(parts)
            + (f"; {', '.join(kept)} continue{'s' if len(kept) == 1 else ''} where "
               f"{'it was' if len(kept) == 1 else 'they were'}" if kept else "")
            + ("; the mixer counts tokens afresh at the new weights"
               if weights or added or dropped or len(kept) < len(current) else ""))


def saved_seed_offset(saved_metadata: dict) -> int:
    """The seed offset of the stream a saved iterator state belongs to: the step at which that
    run's data last restarted (0 if it never did, or if saved before offsets were recorded). A
    resume builds its iterator with it, so the state continues its own stream."""
    return int((saved_metadata.get(DATA_STREAM) or {}).get("seed_offset", 0))


def _saved_packing(saved_record: dict, saved_config: dict, saved_metadata: dict) -> tuple[dict, bool]:
    """(the values of the packer's keys the state was saved under, whether they are all there).

    A state saved before they were recorded (an older longctx) gets the ones its config and mesh
    fix: seq_len, the saved mesh's sp and the block size. Not the bins: they come from a
    calibration that may have changed since, and a guess could restart a stream that was fine;
    so such a state, its other keys unchanged, restores as it did before."""
    if saved_record.get("packing") is not None:
        return saved_record["packing"], True
    derived = {packing.SEQ_LEN: _get(saved_config, packing.SEQ_LEN),
               packing.SP: (saved_metadata.get("mesh") or {}).get("sp"),
               packing.BLOCK_SIZE: _get(saved_config, packing.BLOCK_SIZE)}
    return {k: v for k, v in derived.items() if v is not None}, False


def packing_differences(saved: dict, complete: bool, current: dict) -> list[str]:
    """`"mesh.sp: 4 then vs 8 now"` for each packing key whose value differs (`complete`: a
    key only one side has differs too; else only the keys `saved` holds are compared)."""
    keys = [k for k in current if complete or k in saved]
    keys += [k for k in saved if complete and k not in current]
    return [f"{key}: {saved.get(key)!r} then vs {current.get(key)!r} now"
            for key in keys if saved.get(key) != current.get(key)]


def _describe_shard(shard: dict | None) -> str:
    if not shard:
        return "no rows"
    start, stop = shard["rows"]
    return f"data shard {shard['index']} of {shard['count']}, batch rows {start}-{stop - 1}"


def shard_differences(saved: dict, current: dict) -> list[str]:
    """`"process 0: data shard 0 of 2, batch rows 0-1 then, data shard 0 of 1, batch rows 0-3
    now"` for each process whose data shard differs."""
    out = []
    for p in sorted(set(saved) | set(current), key=int):
        if saved.get(p) != current.get(p):
            out.append(f"process {p}: {_describe_shard(saved.get(p))} then, "
                       f"{_describe_shard(current.get(p))} now")
    return out


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """What differs between two `longctx.data.pipeline.dataset_fingerprint`s: the tokenizer, the
    split's counts, and each file's counts and size."""
    out = [f"{key}: {saved.get(key)!r} then vs {current.get(key)!r} now"
           for key in sorted(set(saved) | set(current)) if key != "files"
           and saved.get(key) != current.get(key)]
    saved_files = {f["path"]: f for f in saved.get("files", [])}
    current_files = {f["path"]: f for f in current.get("files", [])}
    for path in sorted(set(saved_files) | set(current_files)):
        then, now = saved_files.get(path), current_files.get(path)
        if then is None or now is None:
            out.append(f"{path} {'only now' if then is None else 'no longer there'}")
        elif then != now:
            out.extend(f"{path} {key}: {then.get(key)!r} then vs {now.get(key)!r} now"
                       for key in sorted(set(then) | set(now)) if then.get(key) != now.get(key))
    return out


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED_DATA
    return "; ".join(items[:_MAX_LISTED_DATA]) + (f"; and {more} more" if more > 0 else "")


# ----------------------------------------------------------------------------- init_from

# Changed on purpose by context extension (docs/extend.md): listed, never refused.
_EXTENSION_KEYS = ("data.seq_len",)


def _rope_scaling(config: dict) -> str:
    """'none', or 'llama3(factor=8.0, ...)': the type and only the values it reads."""
    return _describe_scaling((config.get("model") or {}).get("rope_scaling"))


def _describe_scaling(scaling: dict | None) -> str:
    scaling = scaling or {"type": "none"}
    kind = scaling.get("type", "none")
    values = ", ".join(f"{k}={scaling.get(k)!r}" for k in rope.KEYS_BY_TYPE.get(kind, ()) if scaling.get(k) is not None)
    return f"{kind}({values})" if values else kind


def init_from_differences(saved: dict, current: dict, allowed) -> tuple[list[str], list[str]]:
    """(changes to list, changes to refuse) between init_from's saved config and this run's.

    Listed: the context-extension changes (data.seq_len; RoPE scaling added to a model that had
    none) and the differences `allowed` names. Refused: every other config.INIT_FROM_KEYS difference."""
    listed, refused = config_differences(saved, current, _EXTENSION_KEYS), []
    for key in config_lib.INIT_FROM_KEYS:
        if key == "attention.pattern":  # (compared layer by layer, below)
            continue
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
    for key, before, text in layer_type_differences(saved, current, config_lib.INIT_FROM_TYPE_KEYS):
        extension = key.endswith(".rope_scaling") and before == "none"  # (a type's own extension)
        (listed if extension or key in allowed else refused).append(text)
    return listed, refused


def layer_type_differences(saved: dict, current: dict, keys) -> list[tuple[str, object, str]]:
    """(key, checkpoint's value, "key: checkpoint X vs config Y") for what the layer types of two
    configs set differently among `keys` (config.INIT_FROM_TYPE_KEYS, or attention_sinks).

    Layer by layer, each side's type resolved against its own attention.* / model.* (as
    layer_types.resolve does), a key compared where either layer's type sets it: a difference of
    attention.* itself is its own key's. With the same pattern a difference is the type's key,
    attention.layer_types.<name>.<key>; with another pattern it is attention.pattern, with the
    first layer that differs (a pattern whose types are renamed, or spelled out on the other side,
    computes what it did)."""
    names = {side: layer_types.pattern({"pattern": _get(config, "attention.pattern")})
             for side, config in (("saved", saved), ("current", current))}
    same = names["saved"] == names["current"]
    found = {}
    for layer in range(_get(current, "model.num_layers") or 0):
        then = names["saved"][layer % len(names["saved"])]
        now = names["current"][layer % len(names["current"])]
        for key in keys:
            if key not in _type_settings(saved, then) and key not in _type_settings(current, now):
                continue
            before, after = _type_value(saved, then, key), _type_value(current, now, key)
            if before == after:
                continue
            shown = (f"{before} vs config {after}" if key == "rope_scaling"  # (already text)
                     else f"{before!r} vs config {after!r}")
            if same:
                name = f"attention.layer_types.{now}.{key}"
                found.setdefault(name, (name, before, f"{name}: checkpoint {shown}"))
            else:
                found.setdefault("attention.pattern", (
                    "attention.pattern", None,
                    f"attention.pattern: checkpoint {_get(saved, 'attention.pattern')!r} vs config "
                    f"{_get(current, 'attention.pattern')!r} (layer {layer}'s {key}: checkpoint {shown})"))
    return list(found.values())


def _type_settings(config: dict, name: str) -> dict:
    """The keys layer type `name` sets (none for the one type of a model without a pattern)."""
    if name == layer_types.UNIFORM:
        return {}
    return dict((_get(config, "attention.layer_types") or {}).get(name) or {})


def _type_value(config: dict, name: str, key: str):
    """Layer type `name`'s `key`: its own, else what layer_types.resolve takes for it (RoPE
    scaling: model.rope_scaling with the type's keys over it, described as _rope_scaling does)."""
    own = _type_settings(config, name)
    if key == "rope_scaling":
        return _describe_scaling({**(_get(config, "model.rope_scaling") or {}), **(own.get("rope_scaling") or {})})
    if key in own:
        return own[key]
    if key == "rope":
        return True
    if key == "rope_theta":
        return _get(config, "model.rope_theta")
    if key in layer_types.TEMPERATURE_KEYS:
        return None
    return _get(config, f"attention.{key}")
