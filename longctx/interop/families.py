"""The Hugging Face model families longctx converts: each one's config.json as longctx config keys, and back.

  architecture        model_type   block options (longctx/model/block_options.py)   layer types
  LlamaForCausalLM    llama        (Llama's)                                        full
  MistralForCausalLM  mistral      (Llama's)                                        all sliding, with a window
  Qwen2ForCausalLM    qwen2        qkv_bias                                         full; sliding from
                                                                                    max_window_layers on
  Qwen3ForCausalLM    qwen3        qk_norm=per_head                                 (as Qwen2)
  Gemma3ForCausalLM   gemma3_text  qk_norm=per_head, norm_position=sandwich,        5 sliding : 1 full,
                                   norm_plus_one, mlp_activation=gelu_tanh,         RoPE per type
                                   scale_embeddings, query_pre_attn_scalar
  Olmo3ForCausalLM    olmo3        qk_norm=whole, norm_position=post                3 sliding : 1 full, RoPE
                                                                                    scaling on full only

A family is data here, and the only place longctx names one: the model itself only sees block
options and layer types. `layer_types` (transformers 5) or the older spellings (Qwen's
`use_sliding_window` + `max_window_layers`, Gemma's `sliding_window_pattern`) give each layer's type;
the shortest period that repeats them (a remainder allowed) becomes `attention.pattern` with the
types `sliding` and `full` (one type: no pattern, attention.* itself). RoPE per type comes from
`rope_parameters` keyed by layer type, or Gemma's `rope_local_base_freq` beside `rope_theta` and
`rope_scaling` (full layers only); the full type's RoPE is model.rope_theta / model.rope_scaling and
the sliding type sets its own where it differs. Sliding windows: HF's W keys are longctx's w = W - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from longctx.errors import ConfigError
from longctx.model import block_options
from longctx.model import layer_types as layer_types_lib
from longctx.model import rope as rope_lib

SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer type names
TYPE_NAMES = {SLIDING: "sliding", FULL: "full"}  # longctx's layer types for them


def _all_full(hf: dict, n: int) -> list[str]:
    return [FULL] * n


def _all_sliding_with_a_window(hf: dict, n: int) -> list[str]:
    return [SLIDING if hf.get("sliding_window") is not None else FULL] * n


def _max_window_layers(hf: dict, n: int) -> list[str]:
    """Qwen2/3's older spelling: with use_sliding_window, layers from max_window_layers on slide."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return [FULL] * n
    first = hf.get("max_window_layers", 28)
    return [SLIDING if i >= first else FULL for i in range(n)]


def _every(default: int, key: str | None = None) -> Callable[[dict, int], list[str]]:
    """Gemma 3's `sliding_window_pattern` (default 6), OLMo 3's fixed 4: every p-th layer is full."""
    def types(hf: dict, n: int) -> list[str]:
        p = int(hf.get(key) or default) if key else default
        return [SLIDING if (i + 1) % p else FULL for i in range(n)]
    return types


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    block: dict  # the block options (block_options.DEFAULTS keys) that differ from Llama's
    older_layer_types: Callable[[dict, int], list[str]]  # for a config.json without layer_types
    activation_key: str = "hidden_act"
    writes_layer_types: bool = True  # config.json has layer_types (and the window with them)
    rope_per_type: bool = False  # RoPE per layer type (rope_parameters keyed by type)
    attention_bias_key: bool = True  # an attention_bias key (which biases o_proj too)


FAMILIES = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", {}, _all_full, writes_layer_types=False),
    Family("MistralForCausalLM", "mistral", {}, _all_sliding_with_a_window, writes_layer_types=False,
           attention_bias_key=False),
    Family("Qwen2ForCausalLM", "qwen2", {"qkv_bias": True}, _max_window_layers, attention_bias_key=False),
    Family("Qwen3ForCausalLM", "qwen3", {"qk_norm": "per_head"}, _max_window_layers),
    Family("Gemma3ForCausalLM", "gemma3_text", {
        "qk_norm": "per_head", "norm_position": "sandwich", "norm_plus_one": True,
        "mlp_activation": "gelu_tanh", "scale_embeddings": True}, _every(6, "sliding_window_pattern"),
        activation_key="hidden_activation", rope_per_type=True),
    Family("Olmo3ForCausalLM", "olmo3", {"qk_norm": "whole", "norm_position": "post"}, _every(4),
           rope_per_type=True),
)}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's name -> model.mlp_activation

# What to convert instead of an architecture longctx does not have.
_MIXTURE_OF_EXPERTS = ("is a mixture-of-experts model and longctx's MLP is dense: convert a dense model "
                       "(Qwen3ForCausalLM, Olmo3ForCausalLM, LlamaForCausalLM, ...).")
_MULTIMODAL = ("holds vision/audio towers that longctx does not have: convert its text model (for Gemma 3, "
               "a Gemma3ForCausalLM checkpoint such as gemma-3-1b, or the language model saved on its own "
               "with Gemma3ForCausalLM.save_pretrained).")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def family_of(hf: dict, where: str) -> Family:
    """The family of a config.json; one sentence for anything else, with what to convert instead."""
    arch = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if any(hf.get(key) for key in _EXPERT_KEYS) or "Moe" in str(arch) or "MoE" in str(arch):
        raise ConfigError(f"{where}: {arch} {_MIXTURE_OF_EXPERTS}")
    if "vision_config" in hf or "audio_config" in hf or str(arch).endswith("ForConditionalGeneration"):
        raise ConfigError(f"{where}: {arch} {_MULTIMODAL}")
    family = FAMILIES.get(arch)
    if family is None or family.model_type != model_type:
        raise ConfigError(f"{where}: architecture {arch!r} (model_type {model_type!r}) is not supported; "
                          f"longctx converts {', '.join(FAMILIES)}.")
    return family


def layer_types_of(hf: dict, family: Family, num_layers: int, where: str) -> list[str]:
    """Each layer's HF type: `layer_types`, else the family's older spelling."""
    types = hf.get("layer_types") or family.older_layer_types(hf, num_layers)
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}.")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(f"{where}: layer type {unknown[0]!r} is not supported (longctx converts "
                          f"{SLIDING!r} and {FULL!r} layers).")
    if SLIDING in types and hf.get("sliding_window") is None:
        raise ConfigError(f"{where}: layer_types has {SLIDING!r} layers but sliding_window is not set.")
    return list(types)


def shortest_period(types: list[str]) -> list[str]:
    """The shortest pattern whose repetition (the last period possibly cut short) gives `types`."""
    return next(types[:p] for p in range(1, len(types) + 1)
                if all(t == types[i % p] for i, t in enumerate(types)))


def _rope(params: dict | None, theta_default, max_position, where) -> tuple[float, dict]:
    theta = (params or {}).get("rope_theta", theta_default)
    return float(10_000.0 if theta is None else theta), rope_lib.from_hf(params, max_position, where)


def rope_by_type(hf: dict, family: Family, where: str) -> dict[str, tuple[float, dict]]:
    """{HF type: (theta, model.rope_scaling values)} for both types (equal where the family has one RoPE)."""
    params, max_position = hf.get("rope_parameters"), hf.get("max_position_embeddings")
    partial = (params or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial} is not supported (RoPE on the whole head).")
    if params and any(isinstance(v, dict) for v in params.values()):
        if not family.rope_per_type:
            raise ConfigError(f"{where}: rope_parameters per layer type is not supported for "
                              f"{family.architecture} (one RoPE for all layers).")
        return {t: _rope(params.get(t) or {"rope_type": "default"}, hf.get("rope_theta"), max_position, where)
                for t in (SLIDING, FULL)}
    full = _rope(params if params else hf.get("rope_scaling"), hf.get("rope_theta"), max_position, where)
    if not family.rope_per_type:
        return {SLIDING: full, FULL: full}
    # The older spelling: the scaling is the full layers'; Gemma's sliding layers have their own theta.
    local_theta = hf.get("rope_local_base_freq", 10_000.0 if family.model_type == "gemma3_text" else full[0])
    return {SLIDING: (float(local_theta), {"type": "none"}), FULL: full}


def _shape(hf: dict, where: str) -> dict[str, Any]:
    def need(key):
        if hf.get(key) is None:
            raise ConfigError(f"{where} has no {key!r}.")
        return hf[key]

    heads, d_model = need("num_attention_heads"), need("hidden_size")
    return {"model.vocab_size": need("vocab_size"), "model.d_model": d_model,
            "model.num_layers": need("num_hidden_layers"), "model.num_heads": heads,
            "model.num_kv_heads": hf.get("num_key_value_heads") or heads,
            "model.head_dim": hf.get("head_dim") or d_model // heads,
            "model.mlp_dim": need("intermediate_size")}


def config_overrides(hf: dict, where: str) -> dict[str, Any]:
    """The longctx config values (dotted keys) that describe the model in a HF config.json."""
    family = family_of(hf, where)
    activation = hf.get(family.activation_key, hf.get("hidden_act", "silu"))
    if activation not in ACTIVATIONS:
        raise ConfigError(f"{where}: {family.activation_key}={activation!r} is not supported (longctx's "
                          f"gated MLP takes {' or '.join(ACTIVATIONS)}).")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported (longctx's projections have no bias "
                              "but Qwen2's on q, k and v; this one's has one on the output projection too).")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported; "
                          "longctx trains causal decoders.")
    out = _shape(hf, where)
    num_layers = out["model.num_layers"]
    options = {**block_options.DEFAULTS, **family.block, "mlp_activation": ACTIVATIONS[activation]}
    if family.model_type == "gemma3_text":
        options["query_pre_attn_scalar"] = float(hf.get("query_pre_attn_scalar", 256))
    out.update({f"model.{key}": value for key, value in options.items()})
    final_cap, attention_cap = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    out.update({
        "model.norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "model.tie_embeddings": bool(hf.get("tie_word_embeddings", family.model_type == "gemma3_text")),
        "model.final_logits_soft_cap": None if final_cap is None else float(final_cap),
        "attention.causal": True, "attention.attention_sinks": False,
        "attention.logits_soft_cap": None if attention_cap is None else float(attention_cap),
        "attention.chunk_size": None, "attention.sliding_window": None,
        "attention.pattern": "", "attention.layer_types": {},
    })
    types = layer_types_of(hf, family, num_layers, where)
    ropes = rope_by_type(hf, family, where)
    window = hf.get("sliding_window")
    if SLIDING in types and window < 2:
        raise ConfigError(f"{where}: sliding_window={window} is too small (longctx's window w = "
                          "sliding_window - 1 must be at least 1).")
    # The full type's RoPE (or the sliding one's, in a model with no full layer) is model.*'s.
    theta, scaling = ropes[FULL if FULL in types else SLIDING]
    out["model.rope_theta"] = theta
    out.update({f"model.rope_scaling.{k}": v for k, v in scaling.items()})
    if len(set(types)) == 1:
        out["attention.sliding_window"] = int(window) - 1 if types[0] == SLIDING else None
        return out
    sliding = {"sliding_window": int(window) - 1}
    if ropes[SLIDING] != ropes[FULL]:
        sliding.update(rope_theta=ropes[SLIDING][0], rope_scaling=dict(ropes[SLIDING][1]))
    out["attention.pattern"] = ",".join(TYPE_NAMES[t] for t in shortest_period(types))
    out["attention.layer_types"] = {TYPE_NAMES[SLIDING]: sliding, TYPE_NAMES[FULL]: {}}
    return out


# ----------------------------------------------------------------------------- export


def hf_layer_types(config) -> list[str]:
    """Each layer's HF type: sliding where its layer type has a window."""
    names = layer_types_lib.pattern(config.attention)
    resolved = {t.name: t for t in layer_types_lib.period(config)}
    return [SLIDING if resolved[names[i % len(names)]].attention.sliding_window is not None else FULL
            for i in range(config.model.num_layers)]


def _type_rope(config, name: str) -> tuple[float, dict | None]:
    """(theta, HF rope dict or None) of layer type `name`."""
    own = {} if name == layer_types_lib.UNIFORM else dict(config.attention.layer_types[name])
    return float(own.get("rope_theta", config.model.rope_theta)), rope_lib.to_hf(
        layer_types_lib.rope_scaling(config, name))


def _unsupported(config, family: Family | None) -> str | None:
    """What of `config` Hugging Face's families (or `family`) cannot express, or None."""
    m, a = config.model, config.attention
    gemma = family is not None and family.model_type == "gemma3_text"
    checks = [(not a.causal, "attention.causal=False"), (a.chunk_size is not None, "attention.chunk_size"),
              (a.attention_sinks, "attention.attention_sinks"),
              (a.logits_soft_cap is not None and not gemma, "attention.logits_soft_cap"),
              (m.final_logits_soft_cap is not None and not gemma, "model.final_logits_soft_cap")]
    for layer_type in layer_types_lib.period(config):
        prefix, t = layer_types_lib.type_prefix(layer_type.name), layer_type.attention
        checks += [(t.chunk_size is not None, f"{prefix}chunk_size"),
                   (bool(t.attention_sinks), f"{prefix}attention_sinks"),
                   (t.logits_soft_cap != a.logits_soft_cap, f"{prefix}logits_soft_cap"),
                   (layer_type.rotary is None, f"{prefix}rope=False"),
                   (layer_type.temperature is not None, f"{prefix}temperature_floor")]
    return next((what for bad, what in checks if bad), None)


def export_family(config, template: dict | None) -> Family:
    """The family a longctx model exports as: the template's where the model is one of it, else
    the one whose block options it has (Llama's block with a window: Mistral)."""
    options = dataclasses.asdict(block_options.options(config.model))
    scalar = options.pop("query_pre_attn_scalar")
    types = hf_layer_types(config)
    fits = [f for f in FAMILIES.values()
            if {k: v for k, v in {**block_options.DEFAULTS, **f.block}.items() if k in options} == options
            and (f.writes_layer_types or len(set(types)) == 1)
            and (f.model_type != "llama" or SLIDING not in types)
            and (f.model_type != "mistral" or SLIDING in types)]
    if scalar is not None and float(scalar) != float(config.model.head_dim):
        fits = [f for f in fits if f.model_type == "gemma3_text"]
    arch = (template or {}).get("architectures", [None])[0]
    chosen = next((f for f in fits if f.architecture == arch), fits[0] if fits else None)
    if chosen is None:
        chosen_options = {k: v for k, v in options.items() if v != block_options.DEFAULTS[k]}
        raise ConfigError(f"a model with block options {chosen_options or 'of Llama'} and layer types "
                          f"{sorted(set(types))} is none of the Hugging Face families longctx exports "
                          f"({', '.join(FAMILIES)}); this model cannot be exported.")
    return chosen


# Keys of a template config.json that the export sets (or that would contradict what it sets).
_SET_BY_EXPORT = ("rope_scaling", "rope_parameters", "rope_theta", "rope_local_base_freq", "torch_dtype", "dtype",
                  "sliding_window", "transformers_version", "layer_types", "use_sliding_window",
                  "max_window_layers", "sliding_window_pattern", "_sliding_window_pattern", "hidden_act",
                  "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                  "attn_logit_softcapping", "attention_bias", "mlp_bias")


def export_config(config, dtype_name: str, max_position_embeddings: Callable[[dict | None, int | None, int], int],
                  template: dict | None = None) -> dict:
    """A HF config.json for the longctx model in `config`. `template` (the source model's
    config.json) keeps the fields longctx does not know (token ids, ...)."""
    unsupported = _unsupported(config, FAMILIES["Gemma3ForCausalLM"])  # (what no family has)
    if unsupported:
        raise ConfigError(f"{unsupported} has no Hugging Face equivalent; this model cannot be exported.")
    family = export_family(config, template)
    unsupported = _unsupported(config, family)
    if unsupported:
        raise ConfigError(f"{unsupported} has no Hugging Face {family.architecture} equivalent; this "
                          "model cannot be exported.")
    m, a = config.model, config.attention
    types = hf_layer_types(config)
    names = layer_types_lib.pattern(a)
    type_of = [names[i % len(names)] for i in range(m.num_layers)]
    windows = {layer_types_lib.resolve(config, n).attention.sliding_window for n, t in zip(type_of, types)
               if t == SLIDING}
    # {HF type: [(theta, HF rope dict)] of its layers, each distinct one once}
    ropes = {t: [] for t in types}
    for n, t in zip(type_of, types):
        if _type_rope(config, n) not in ropes[t]:
            ropes[t].append(_type_rope(config, n))
    if len(windows) > 1:
        raise ConfigError(f"sliding windows {sorted(windows)} on different layer types have no Hugging Face "
                          "equivalent (one sliding_window); this model cannot be exported.")
    distinct = [r for i, r in enumerate(sum(ropes.values(), [])) if r not in sum(ropes.values(), [])[:i]]
    if any(len(r) > 1 for r in ropes.values()) or (not family.rope_per_type and len(distinct) > 1):
        raise ConfigError(f"RoPE per layer type ({distinct}) has no {family.architecture} equivalent; this "
                          "model cannot be exported.")
    full_theta, full_rope = ropes[FULL if FULL in ropes else SLIDING][0]
    out = {k: v for k, v in (template or {}).items() if k not in _SET_BY_EXPORT}
    window = None if not windows else int(next(iter(windows))) + 1
    out.update({
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        family.activation_key: {v: k for k, v in ACTIVATIONS.items()}[block_options.options(m).mlp_activation],
        "rms_norm_eps": m.norm_eps, "tie_word_embeddings": bool(m.tie_embeddings),
        "max_position_embeddings": max_position_embeddings(full_rope, out.get("max_position_embeddings"),
                                                           config.data.seq_len),
        # The spelling of released Llama-3.1 checkpoints: transformers 4.x reads only this, 5.x both.
        "rope_theta": full_theta, "rope_scaling": full_rope,
        "torch_dtype": dtype_name,
    })
    if family.attention_bias_key:
        out["attention_bias"] = False
    if family.model_type == "llama":
        out["mlp_bias"] = False
    if family.model_type == "mistral":
        out["sliding_window"] = window
    if family.writes_layer_types:
        out.update(layer_types=types, sliding_window=window)
    if family.older_layer_types is _max_window_layers:
        # (read only with use_sliding_window, by configs without layer_types: the template's otherwise)
        first = next((i for i, t in enumerate(types) if t == SLIDING), None)
        out.update(use_sliding_window=first is not None, max_window_layers=first if first is not None else
                   (template or {}).get("max_window_layers", len(types)))
    if family.rope_per_type:
        sliding_theta, sliding_rope = ropes.get(SLIDING, ropes[FULL])[0]
        out["rope_parameters"] = {t: {**(rope or {"rope_type": "default"}), "rope_theta": theta}
                                  for t, (theta, rope) in ((SLIDING, (sliding_theta, sliding_rope)),
                                                           (FULL, (full_theta, full_rope)))}
    if family.model_type == "gemma3_text":
        scalar = block_options.options(m).query_pre_attn_scalar
        scalar = float(m.head_dim if scalar is None else scalar)
        out.update(query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                   final_logit_softcapping=m.final_logits_soft_cap, attn_logit_softcapping=a.logits_soft_cap,
                   rope_local_base_freq=out["rope_parameters"][SLIDING]["rope_theta"])
    return out
