"""`validate(config)`: every cross-field rule of a longctx config, checked before anything compiles.

Each rule raises `ConfigError` with one sentence that names the offending key and its value, so a
bad launch fails in seconds with a message a person can act on, not minutes later inside XLA.
"""

from __future__ import annotations

import math
import numbers

import jax
import ml_collections

from longctx import ops
from longctx.data import mixture, packing
from longctx.errors import ConfigError  # noqa: F401  (re-exported: callers use config.ConfigError)
from longctx.model import attention, block_options, decoder, rope
from longctx.model import layer_types as layer_types_lib
from longctx.ops import blocks, context_parallel
from longctx.parallel import layout
from longctx.parallel import mesh as mesh_lib

DTYPES = ("float32", "bfloat16")  # (not float16: it needs loss scaling, which longctx does not do)
NONFINITE_ACTIONS = ("stop", "skip")


# Config keys that, besides the shapes, define the function a model's parameters compute: a run
# started (checkpoint.init_from) from parameters trained with other values trains another
# function, e.g. a converted Llama read with the wrong rope_theta or without its window. A
# difference is refused unless checkpoint.init_from_allow names the key (train/checkpoint_compat.py
# compares them). model.rope_scaling is one key: its type and the values that type reads. The
# block options that add no parameters are here (those that do are shape keys); attention.pattern
# is the layer types layer by layer (a renamed type computes what it did).
INIT_FROM_KEYS = ("model.rope_theta", "model.rope_scaling", "model.norm_eps", "model.final_logits_soft_cap",
                  "model.norm_plus_one", "model.mlp_activation", "model.scale_embeddings",
                  "model.query_pre_attn_scalar",
                  "attention.causal", "attention.sliding_window", "attention.chunk_size",
                  "attention.logits_soft_cap", "attention.pattern")
# The keys of a layer type that init_from compares type by type, as
# attention.layer_types.<name>.<key> (its mask and RoPE; not its strategy or block size).
INIT_FROM_TYPE_KEYS = ("sliding_window", "chunk_size", "logits_soft_cap", "rope", "rope_theta", "rope_scaling",
                       "temperature_floor", "temperature_scale")


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> None:
    """Sets dotted keys ("model.num_layers": 4) on a (locked) ConfigDict; ints become floats where
    the field is a float. The one setter of dotted keys (the converter's overrides, a grid's
    variants, a saved config changed for inference): an unknown key raises KeyError, a value of the
    wrong type TypeError, for the caller to put in its own words. A layer type's key
    (attention.layer_types.<type>.<key>) is set whether or not the type sets it yet: a type holds
    only what sets it apart (longctx/model/layer_types.py)."""
    for key, value in overrides.items():
        *sections, name = key.split(".")
        if _new_type_key(config, sections, name):
            layer_types_lib.set_type_key(config, sections[2], name, value)
            continue
        node = config
        for section in sections:
            node = node[section]
        if name not in node:
            raise KeyError(key)
        if isinstance(node[name], float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        node[name] = value


def _new_type_key(config, sections: list[str], name: str) -> bool:
    """Whether `sections`.`name` is attention.layer_types.<type>.<key>, a key a type may set
    (layer_types.TYPE_KEYS) that the config's type does not set yet."""
    if sections[:2] != ["attention", "layer_types"] or len(sections) != 3 or name not in layer_types_lib.TYPE_KEYS:
        return False
    return name not in ((config.attention.get("layer_types") or {}).get(sections[2]) or {})


def init_from_allowed(config) -> tuple[str, ...]:
    """The keys of `checkpoint.init_from_allow` ("key,key"; absent from older configs)."""
    text = config.checkpoint.get("init_from_allow") or ""
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _choices() -> dict[str, tuple]:
    """Allowed values of the keys that name an implementation, each from the module that
    implements them."""
    return {"attention.impl": ops.IMPLS, "attention.layout": layout.LAYOUTS + layout.ROW_LAYOUTS + ("auto",),
            "attention.residuals": attention.RESIDUAL_POLICIES, "data.packer": packing.PACKERS,
            "model.dtype": DTYPES, "model.param_dtype": DTYPES,
            "model.remat_policy": tuple(decoder.REMAT_POLICIES), "train.on_nonfinite": NONFINITE_ACTIONS}


def _check_context_parallel(a, heads: int, sp: int, prefix: str = "attention.") -> None:
    """attention.cp against the heads and the sp size, by the strategy's own rule
    (ops/strategy.py `config_problem`); `prefix` names the keys (a layer type's,
    longctx/model/layer_types.py)."""
    strategy, degree = attention.cp_name(a), a.get("cp_ulysses")
    cp, cp_ulysses = f"{prefix}cp", f"{prefix}cp_ulysses"
    _require(strategy != "auto", _chosen_by_the_planner(cp))
    _one_of_values(cp, strategy, context_parallel.STRATEGIES)
    chosen = context_parallel.REGISTRY[strategy]
    if not chosen.takes_degree:
        takers = " or ".join(f"{cp}={name}" for name, c in context_parallel.REGISTRY.items()
                             if c.takes_degree)
        _require(degree is None, f"{cp_ulysses}={degree} is the Ulysses degree of {takers}, "
                 f"not of {cp}={strategy}: unset it or set {takers}.")
    problem = chosen.config_problem(heads, sp, degree, cp, cp_ulysses)
    _require(problem is None, problem)


def _chosen_by_the_planner(key: str) -> str:
    return (f"{key}=auto is chosen by the planner as a script starts (scripts/train.py, "
            "estimate.py); code that calls train_and_evaluate itself resolves it first with "
            "longctx.plan.auto.resolve(config, jax.devices()).")


def _check_block_size(block, prefix: str = "attention.") -> None:
    """attention.block_size holds an int or "auto" (configs/base.py types it `object` for that)."""
    _require(block != "auto", _chosen_by_the_planner(f"{prefix}block_size"))
    _require(isinstance(block, numbers.Integral) and not isinstance(block, bool) and block > 0,
             f"{prefix}block_size={block!r} must be a positive integer (or auto, for the planner "
             "to choose when the run starts).")


def _one_of_values(key: str, value, choices) -> None:
    _require(value in choices, f"{key}={value!r} is not one of {', '.join(map(repr, choices))}.")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _one_of(config, key: str, choices) -> None:
    section, name = key.split(".")
    _one_of_values(key, config[section][name], choices)


def _positive(config, *keys: str) -> None:
    for key in keys:
        section, name = key.split(".")
        value = config[section][name]
        _require(value is not None and value > 0, f"{key}={value!r} must be positive.")


def _check_sources(config) -> None:
    """data.sources (a mixture, data/mixture.py): each source a path, a positive weight, length
    bounds and an upsampling factor that make sense; data.path left empty beside it."""
    given = config.data.get("sources") or {}
    if not given:
        return
    _require(not config.data.path, f"data.path={config.data.path!r} and data.sources are both set: "
             "a mixture names every directory in data.sources, so set --config.data.path=''.")
    for name in sorted(given):
        key = f"data.sources.{name}"
        source = given[name]
        _require(isinstance(source, (dict, ml_collections.ConfigDict)),
                 f"{key}={source!r} must be a dict of {', '.join(mixture.SOURCE_DEFAULTS)}.")
        unknown = sorted(set(source) - set(mixture.SOURCE_DEFAULTS))
        _require(not unknown, f"{key} has unknown key(s) {', '.join(unknown)}: a source takes "
                 f"{', '.join(mixture.SOURCE_DEFAULTS)}.")
        s = {**mixture.SOURCE_DEFAULTS, **dict(source)}
        _require(isinstance(s["path"], str) and s["path"],
                 f"{key}.path={s['path']!r} must name a prepared directory (or "
                 f"{mixture.EMBEDDED_FILES} / {mixture.EMBEDDED_PACKAGES}).")
        embedded = (mixture.EMBEDDED_FILES, mixture.EMBEDDED_PACKAGES)
        _require(not s["path"].startswith("embedded:") or s["path"] in embedded,
                 f"{key}.path={s['path']} names no embedded source: the embedded sources are "
                 f"{mixture.EMBEDDED_FILES} (the Python standard library, one file per document) and "
                 f"{mixture.EMBEDDED_PACKAGES} (one top-level package per document).")
        for k in ("weight", "upsample_factor"):
            _require(isinstance(s[k], numbers.Real) and not isinstance(s[k], bool) and math.isfinite(s[k]),
                     f"{key}.{k}={s[k]!r} must be a number.")
        for k in ("min_length", "max_length", "upsample_above"):
            _require(isinstance(s[k], numbers.Integral) and not isinstance(s[k], bool) and s[k] >= 0,
                     f"{key}.{k}={s[k]!r} must be a whole number of tokens >= 0 (0: no bound).")
        _require(s["weight"] > 0, f"{key}.weight={s['weight']!r} must be positive (leave the source "
                 "out to read none of it).")
        _require(not s["max_length"] or s["max_length"] >= s["min_length"],
                 f"{key}.max_length={s['max_length']} is below its min_length={s['min_length']}.")
        _require(s["upsample_factor"] >= 1, f"{key}.upsample_factor={s['upsample_factor']!r} must "
                 "be >= 1 (a long document read that many times per epoch; shorten with max_length).")
        _require(s["upsample_factor"] == 1 or s["upsample_above"] > 0,
                 f"{key}.upsample_factor={s['upsample_factor']!r} needs upsample_above, the length in "
                 "tokens from which a document counts as long.")


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> dict[str, int]:
    """Checks `config` against itself and the devices; returns the resolved mesh sizes.

    `num_devices` defaults to `jax.device_count()` (after distributed start-up, all processes).
    """
    if num_devices is None:
        num_devices = jax.device_count()

    m, a, d, o, t, c = (config.model, config.attention, config.data, config.optimizer,
                        config.train, config.checkpoint)

    for key in ("model.dtype", "model.param_dtype"):
        _require(config.model[key.split(".")[1]] != "float16",
                 f"{key}='float16' trains without loss scaling, which longctx does not do, so small "
                 f"gradients underflow to zero: set {key}=bfloat16 (float32's range) or float32.")
    for key, choices in _choices().items():
        _one_of(config, key, choices)
    _check_block_size(a.block_size)
    _positive(config, "model.vocab_size", "model.d_model", "model.num_layers", "model.num_heads",
              "model.num_kv_heads", "model.head_dim", "model.mlp_dim", "model.rope_theta",
              "data.seq_len", "data.global_batch_size", "optimizer.learning_rate",
              "train.num_steps", "train.log_every", "train.loss_chunk_size")

    # Mesh against the devices (raises ValueError with its own sentence).
    try:
        sizes = mesh_lib.resolve_mesh_shape(config.mesh, num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dcn = {ax: config.mesh[f"dcn_{ax}"] for ax in mesh_lib.MESH_AXES}
    dp, fsdp, sp = (sizes[ax] * dcn[ax] for ax in mesh_lib.MESH_AXES)

    # Model shape.
    _require(m.num_heads % m.num_kv_heads == 0,
             f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}.")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for RoPE.")
    # Parameters are split over fsdp x sp along d_model (longctx.parallel.mesh.PARAM_AXES); the optimizer
    # state over dp too with optimizer.shard_state_over_dp.
    over_dp = bool(o.get("shard_state_over_dp", False))
    mesh_sizes = {mesh_lib.DP: dp, mesh_lib.FSDP: fsdp, mesh_lib.SP: sp}
    axes = mesh_lib.split_axes("embed", over_dp=over_dp)
    ways = math.prod(mesh_sizes[ax] for ax in axes)
    _require(m.d_model % ways == 0,
             f"model.d_model={m.d_model} is not divisible by {'*'.join(axes)} = "
             f"{'*'.join(str(mesh_sizes[ax]) for ax in axes)} = {ways}, the number of ways the "
             f"{'optimizer state is' if over_dp else 'parameters are'} split.")

    _check_rope_scaling(m.get("rope_scaling"))  # (absent from configs saved before it existed)
    _check_block_options(m)

    _check_mask(a)
    _check_context_parallel(a, m.num_heads, sp)

    placed_for = packing.packer_layout(d.packer)  # shard_balanced places documents in contiguous shards
    _require(placed_for is None or a.layout in (placed_for, "auto"),
             f"data.packer={d.packer!r} places documents in the shards of the {placed_for} layout, which "
             f"attention.layout={a.layout!r} would scatter: set --config.attention.layout={placed_for} or auto.")

    _require(not layout.per_row(a.layout) or a.use_segment_ids,
             f"attention.layout={a.layout!r} places each document of a row on its own, which needs "
             "the document mask: set --config.attention.use_segment_ids=True or another layout.")

    # Sequence against the ring and the kernel blocks.
    seq_divisor = 2 * sp if a.layout == "zigzag" else sp
    _require(d.seq_len % seq_divisor == 0,
             f"data.seq_len={d.seq_len} is not divisible by {seq_divisor} "
             f"({'2*sp for the zigzag layout' if a.layout == 'zigzag' else 'the sp mesh size'}).")
    shard_len = d.seq_len // sp
    _require(shard_len % a.block_size == 0,
             f"attention.block_size={a.block_size} does not divide the per-device shard of "
             f"data.seq_len/sp = {d.seq_len}/{sp} = {shard_len} tokens.")
    _check_splash_block(a.block_size, shard_len, a.impl, a.layout)
    _check_layer_types(config, sp, shard_len)
    mlp_chunk = m.get("mlp_chunk_size")
    if mlp_chunk is not None:
        _require(mlp_chunk > 0, f"model.mlp_chunk_size={mlp_chunk} must be positive (or None).")
        if shard_len % mlp_chunk and shard_len > mlp_chunk:
            raise ConfigError(f"model.mlp_chunk_size={mlp_chunk} does not divide the per-device shard "
                              f"of {shard_len} tokens: set --config.model.mlp_chunk_size="
                              f"{_divisor_below(shard_len, mlp_chunk)}.")
    if shard_len % t.loss_chunk_size:
        raise ConfigError(f"train.loss_chunk_size={t.loss_chunk_size} does not divide the per-device "
                          f"shard of {shard_len} tokens: set --config.train.loss_chunk_size="
                          f"{_divisor_below(shard_len, t.loss_chunk_size)}.")

    _check_sources(config)

    # Batch against data parallelism.
    _require(d.global_batch_size % (dp * fsdp) == 0,
             f"data.global_batch_size={d.global_batch_size} is not divisible by dp*fsdp = {dp}*{fsdp} = {dp * fsdp}: "
             f"set --config.data.global_batch_size={_multiple_above(d.global_batch_size, dp * fsdp)}.")
    accum = t.get("grad_accum_steps", 1)  # (absent from configs saved before it existed)
    _require(isinstance(accum, int) and accum >= 1,
             f"train.grad_accum_steps={accum!r} must be a whole number of micro-batches, at least 1.")
    _require(d.global_batch_size % (dp * fsdp * accum) == 0,
             f"data.global_batch_size={d.global_batch_size} does not split into train.grad_accum_steps={accum} "
             f"micro-batches of whole rows for each of dp*fsdp = {dp * fsdp} data-parallel ranks: set "
             f"--config.data.global_batch_size={_multiple_above(d.global_batch_size, dp * fsdp * accum)} or a "
             f"train.grad_accum_steps that divides {d.global_batch_size // (dp * fsdp)}.")

    # Optimiser and loop.
    _require(o.warmup_steps >= 0, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0.")
    _require(0.0 <= o.min_learning_rate_ratio <= 1.0,
             f"optimizer.min_learning_rate_ratio={o.min_learning_rate_ratio} must be in [0, 1].")
    _require(o.grad_clip_norm is None or o.grad_clip_norm > 0,
             f"optimizer.grad_clip_norm={o.grad_clip_norm} must be positive (or None to disable).")
    skips = t.get("max_consecutive_skips", 1)  # (absent from configs saved before it existed)
    _require(isinstance(skips, int) and skips > 0,
             f"train.max_consecutive_skips={skips!r} must be a positive number of steps.")
    _require(t.eval_every >= 0, f"train.eval_every={t.eval_every} must be >= 0 (0 disables eval).")
    _require(t.eval_every == 0 or t.eval_steps > 0,
             f"train.eval_steps={t.eval_steps} must be positive when train.eval_every > 0.")
    _require(t.get("eval_needle_every", 0) >= 0,
             f"train.eval_needle_every={t.get('eval_needle_every')} must be >= 0 (0 disables the passkey evaluation).")
    _require(t.get("eval_ruler_every", 0) >= 0,
             f"train.eval_ruler_every={t.get('eval_ruler_every')} must be >= 0 (0 disables the RULER evaluation).")
    _require(c.every_steps >= 0, f"checkpoint.every_steps={c.every_steps} must be >= 0 (0 = only at the end).")
    _require(c.max_to_keep >= 1, f"checkpoint.max_to_keep={c.max_to_keep} must be at least 1.")
    _require(c.keep_period is None or c.keep_period > 0,
             f"checkpoint.keep_period={c.keep_period} must be positive.")
    _check_init_from_allow(config)
    return {mesh_lib.DP: dp, mesh_lib.FSDP: fsdp, mesh_lib.SP: sp}


def _check_block_options(m) -> None:
    """The families' block choices (longctx/model/block_options.py; absent from configs saved
    before them: their defaults)."""
    o = block_options.options(m)
    for key, value, choices in (("qk_norm", o.qk_norm, block_options.QK_NORMS),
                                ("norm_position", o.norm_position, block_options.NORM_POSITIONS),
                                ("mlp_activation", o.mlp_activation, block_options.MLP_ACTIVATIONS)):
        _one_of_values(f"model.{key}", value, choices)
    for key in ("qkv_bias", "norm_plus_one", "scale_embeddings"):
        _require(isinstance(getattr(o, key), bool), f"model.{key}={getattr(o, key)!r} must be True or False.")
    scalar = o.query_pre_attn_scalar
    _require(scalar is None or (isinstance(scalar, numbers.Real) and math.isfinite(scalar) and scalar > 0),
             f"model.query_pre_attn_scalar={scalar!r} must be a positive number (attention logits are "
             "scaled by its inverse square root), or None for model.head_dim.")


def _check_init_from_allow(config) -> None:
    """checkpoint.init_from_allow names only keys that init_from compares."""
    types = tuple(config.attention.get("layer_types") or {})
    type_keys = {f"attention.layer_types.{name}.{key}" for name in types for key in INIT_FROM_TYPE_KEYS}
    for key in init_from_allowed(config):
        _require(key in INIT_FROM_KEYS or key in type_keys,
                 f"checkpoint.init_from_allow names {key!r}, which init_from does not compare; it takes "
                 f"a comma-separated list of {', '.join(INIT_FROM_KEYS)}, or of attention.layer_types."
                 f"<type>.<key> for a type of this config and a key of {', '.join(INIT_FROM_TYPE_KEYS)}.")


def _divisor_below(n: int, limit: int) -> int:
    """The largest divisor of `n` not above `limit`: the chunk that fits, closest to the one asked."""
    return max(k for k in range(1, min(n, limit) + 1) if n % k == 0)


def _multiple_above(n: int, factor: int) -> int:
    """The smallest multiple of `factor` not below `n`."""
    return -(-n // factor) * factor


def _check_mask(a, prefix: str = "attention.") -> None:
    """The mask keys of attention.* or of a layer type (`prefix`, with `a` its resolved config)."""
    if a.sliding_window is not None:
        _require(a.sliding_window > 0, f"{prefix}sliding_window={a.sliding_window} must be positive.")
    if a.chunk_size is not None:
        _require(a.chunk_size > 0, f"{prefix}chunk_size={a.chunk_size} must be positive.")
        _require(a.causal, f"{prefix}chunk_size is chunked *causal* attention and needs attention.causal=True: "
                 "set --config.attention.causal=True.")
    if a.logits_soft_cap is not None:
        _require(a.logits_soft_cap > 0, f"{prefix}logits_soft_cap={a.logits_soft_cap} must be positive.")


def _check_layer_types(config, sp: int, shard_len: int) -> None:
    """Each layer type of attention.pattern, as resolved (its keys over attention.*), by the rules
    attention.* itself meets; a message names the type's key (attention.layer_types.<name>.<key>).
    An unknown type or key is one sentence from layer_types itself."""
    types, text = config.attention.get("layer_types") or {}, config.attention.get("pattern") or ""
    _require(not types or text.strip(),
             f"attention.layer_types defines {', '.join(sorted(types))} but attention.pattern is empty, so no "
             f"layer is of them: name them in --config.attention.pattern (one period, in order, e.g. "
             f"{','.join(sorted(types))}) or set --config.attention.layer_types={{}}.")
    period = layer_types_lib.period(config)  # (a type the pattern names and none defines: its sentence)
    unused = sorted(set(types) - {layer_type.name for layer_type in period})
    _require(not unused, f"attention.layer_types.{unused[0] if unused else ''} is defined but attention.pattern="
             f"{text!r} names no layer of it: add it to the pattern, or fix its name if it is misspelt.")
    for layer_type in period:
        if layer_type.name == layer_types_lib.UNIFORM:
            continue
        prefix, a = layer_types_lib.type_prefix(layer_type.name), layer_type.attention
        _check_mask(a, prefix)
        _check_context_parallel(a, config.model.num_heads, sp, prefix)
        _check_block_size(a.block_size, prefix)
        _require(shard_len % a.block_size == 0,
                 f"{prefix}block_size={a.block_size} does not divide the per-device shard of "
                 f"data.seq_len/sp = {config.data.seq_len}/{sp} = {shard_len} tokens.")
        _check_splash_block(a.block_size, shard_len, a.impl, a.layout, prefix)
        theta = config.attention.layer_types[layer_type.name].get("rope_theta")
        _require(theta is None or theta > 0, f"{prefix}rope_theta={theta!r} must be positive.")
        scaling = layer_types_lib.rope_scaling(config, layer_type.name)
        if scaling is not None:
            _check_rope_scaling(ml_collections.ConfigDict(scaling), f"{prefix}rope_scaling")


def _check_splash_block(block: int, shard_len: int, impl: str, layout: str, prefix: str = "attention.") -> None:
    """The kernel's own rule on blocks (longctx/ops/blocks.py), with the block to use where one fits."""
    problem = blocks.block_problem(block, shard_len, impl)
    if problem is None:
        return
    largest = max(block, blocks.SPLASH_BLOCK_MULTIPLE)
    # One inside each zigzag half where there is one, else one the ring accepts (dividing the shard).
    fit = (blocks.fit_block(largest, shard_len, impl, layout)
           or blocks.fit_block(largest, shard_len, impl, "contiguous"))
    fix = (f"set --config.{prefix}block_size={fit}" if fit else
           f"the {shard_len}-token shards hold no such block: use --config.attention.impl=xla or a "
           "longer data.seq_len")
    raise ConfigError(f"{prefix}block_size={block} {problem}; {fix}.")


def _check_rope_scaling(s, key: str = "model.rope_scaling") -> None:
    """The keys `model.rope_scaling.type` reads (longctx/model/rope.py) must describe a real stretch;
    `key` names them (a layer type's: attention.layer_types.<name>.rope_scaling)."""
    if s is None:
        return
    _require(s.type in rope.ROPE_TYPES, f"{key}.type={s.type!r} is not one of "
             f"{', '.join(map(repr, rope.ROPE_TYPES))}.")
    if s.type == "none":
        return
    # A factor below 1 would compress positions: a shorter context, never what scaling is for.
    _require(s.factor is not None and s.factor >= 1.0,
             f"{key}.factor={s.factor!r} must be at least 1 for {s.type} RoPE scaling.")
    if s.type in ("llama3", "yarn"):
        _require(s.original_max_position is not None and s.original_max_position > 0,
                 f"{key}.original_max_position={s.original_max_position!r} must be a "
                 f"positive number of tokens for {s.type} RoPE scaling.")
    if s.type == "llama3":
        _require(0 < s.low_freq_factor < s.high_freq_factor,
                 f"{key}.low_freq_factor={s.low_freq_factor} must be positive and below "
                 f"{key}.high_freq_factor={s.high_freq_factor}.")
    if s.type == "yarn":
        _require(0 < s.beta_slow < s.beta_fast,
                 f"{key}.beta_slow={s.beta_slow} must be positive and below "
                 f"{key}.beta_fast={s.beta_fast}.")
        _require(s.attention_factor is None or s.attention_factor > 0,
                 f"{key}.attention_factor={s.attention_factor} must be positive (or unset).")


def num_params_estimate(config) -> int:
    """Parameter count of the decoder described by `config.model` (for logs and FLOPs)."""
    m = config.model
    attn = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.d_model * m.mlp_dim
    norms = 2 * m.d_model if block_options.options(m).pre_norms else 0
    per_layer = attn + mlp + norms + sum(math.prod(shape) for shape, _, _ in block_options.extra_params(m).values())
    embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    # Every layer has the sinks row when some type reads it (the layers are one stack).
    sinks = m.num_heads if layer_types_lib.any_sinks(config) else 0
    return m.num_layers * (per_layer + sinks) + embed + m.d_model
