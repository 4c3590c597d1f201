"""Rotary position embedding frequencies: plain, linear, llama3 and YaRN, as Hugging Face computes them.

`model.rope_scaling` (configs/base.py) picks one:

  none     inv_freq[j] = theta^(-2j/h), j = 0 .. h/2-1 (h = head_dim)
  linear   inv_freq / factor (position interpolation)
  llama3   Llama 3.1's banded rule: wavelengths shorter than original_max_position/high_freq_factor
           keep their frequency, longer than original_max_position/low_freq_factor are divided by
           factor, and the band between is interpolated smoothly
  yarn     YaRN: per-frequency ramp between interpolation (/ factor) and extrapolation, set by
           beta_fast/beta_slow rotations over original_max_position; and an "attention factor"
           that multiplies cos and sin (so q.k by its square): attention_factor if set, else
           0.1*ln(factor)+1, or with mscale and mscale_all_dim the DeepSeek ratio of the two

Frequencies are computed once on the host, in float32 and in the order transformers computes them
(which is also how Meta's Llama code computes them): a model was trained with those float32
values, and computing them more exactly in float64 moves single frequencies by up to 6 ulp, enough
to move the logits of the llama3 test model by 1.2e-4. tests/model/test_rope.py compares them with
the values transformers' own rotary embedding gives.

`from_hf` / `to_hf` translate between these keys and a Hugging Face rope dict (`rope_scaling` of
released Llama-3.1 checkpoints, or `rope_parameters` of transformers 5). Their meaning follows
transformers 5: YaRN's `factor` is used as given (transformers 4.4x recomputed it from
max_position_embeddings / original_max_position_embeddings when both were present), and a missing
`original_max_position_embeddings` means the config's `max_position_embeddings`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from longctx.errors import ConfigError

ROPE_TYPES = ("none", "linear", "llama3", "yarn")
# Hugging Face rope types that longctx does not implement (they are refused by name).
_HF_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}

# The keys of `model.rope_scaling` each type reads (the others are ignored for it).
KEYS_BY_TYPE = {
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"),
    "yarn": ("factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Rotary:
    """What the model needs: the frequencies, and the scale applied to cos and sin. Compared and
    hashed by value: a layer type holds one, and the decoder's blocks are static data that jax and
    flax compare (a dataclass's own == would compare the arrays element by element)."""

    inv_freq: np.ndarray  # float32 [head_dim // 2]
    attention_scaling: float = 1.0

    def __eq__(self, other) -> bool:
        return (isinstance(other, Rotary) and self.attention_scaling == other.attention_scaling
                and np.array_equal(self.inv_freq, other.inv_freq))

    def __hash__(self) -> int:
        return hash((self.inv_freq.tobytes(), self.attention_scaling))


_F32 = np.float32


def _theta_powers(head_dim: int, theta: float) -> np.ndarray:
    """float32 theta^(2j/h): the exponent rounded to float32, the power rounded once (as torch's
    float32 pow does; numpy's float32 pow can be a bit off)."""
    exponents = np.arange(0, head_dim, 2).astype(_F32) / _F32(head_dim)
    return (np.float64(theta) ** exponents.astype(np.float64)).astype(_F32)


def _reciprocal_times(x: np.ndarray, scalar: float) -> np.ndarray:
    """`scalar / x` as torch evaluates it for a tensor x: reciprocal(x) * scalar, two roundings."""
    return np.reciprocal(x) * _F32(scalar)


def plain_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    return _reciprocal_times(_theta_powers(head_dim, theta), 1.0)


def _llama3(inv_freq: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position"])
    low_freq_wavelen, high_freq_wavelen = _F32(old_context / low), _F32(old_context / high)
    wavelen = _reciprocal_times(inv_freq, 2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / _F32(factor), inv_freq)
    smooth = (_reciprocal_times(wavelen, old_context) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1) - smooth) * scaled / _F32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_attention_factor(s: Mapping[str, Any]) -> float:
    """YaRN's cos/sin scale: `attention_factor` if set, else from `factor` (and the mscales)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(s["factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def _yarn(head_dim: int, theta: float, s: Mapping[str, Any]) -> np.ndarray:
    factor, original = float(s["factor"]), float(s["original_max_position"])
    beta_fast, beta_slow = float(s["beta_fast"] or 32), float(s["beta_slow"] or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns over the original context.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (as transformers) avoids dividing by zero
    powers = _theta_powers(head_dim, theta)
    extrapolated = _reciprocal_times(powers, 1.0)  # the trained frequencies
    interpolated = _reciprocal_times(_F32(factor) * powers, 1.0)  # divided by factor
    ramp = np.clip((np.arange(head_dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    keep = _F32(1) - ramp  # 1: keep the frequency (high frequencies), 0: interpolate
    return interpolated * (_F32(1) - keep) + extrapolated * keep


def rotary(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> Rotary:
    """The frequencies for `model.head_dim`, `model.rope_theta` and `model.rope_scaling`."""
    kind = "none" if not scaling else scaling["type"]
    inv_freq = plain_inv_freq(head_dim, theta)
    attention_scaling = 1.0
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn(head_dim, theta, scaling)
        attention_scaling = yarn_attention_factor(scaling)
    elif kind != "none":
        raise ConfigError(f"model.rope_scaling.type={kind!r} is not one of {', '.join(map(repr, ROPE_TYPES))}.")
    return Rotary(np.asarray(inv_freq, np.float32), float(attention_scaling))


def from_model_config(model_config) -> Rotary:
    return rotary(model_config.head_dim, model_config.rope_theta, model_config.get("rope_scaling"))


# ----------------------------------------------------------------------------- Hugging Face spelling


_HF_NAMES = {"original_max_position": "original_max_position_embeddings"}


def from_hf(rope: Mapping[str, Any] | None, max_position_embeddings: int | None, where: str) -> dict:
    """`model.rope_scaling` values from a Hugging Face rope dict (`rope_scaling` or `rope_parameters`,
    without rope_theta); `where` names the file for errors."""
    rope = dict(rope or {})
    hf_type = rope.get("rope_type", rope.get("type", "default"))
    if hf_type not in _HF_TYPES:
        raise ConfigError(f"{where}: rope type {hf_type!r} is not supported (longctx implements "
                          f"{', '.join(sorted(_HF_TYPES))}).")
    kind = _HF_TYPES[hf_type]
    out: dict[str, Any] = {"type": kind}
    if kind in ("llama3", "yarn") and rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = max_position_embeddings  # (transformers' default)
    if kind == "yarn" and rope.get("factor") is None and max_position_embeddings:
        rope["factor"] = max_position_embeddings / rope["original_max_position_embeddings"]
    for key in KEYS_BY_TYPE[kind]:
        hf_key = _HF_NAMES.get(key, key)
        value = rope.get(hf_key)
        required = key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position")
        if value is None and required:
            raise ConfigError(f"{where}: the {hf_type} rope scaling has no {hf_key!r}.")
        if value is not None:
            out[key] = value
    return out


def to_hf(scaling: Mapping[str, Any] | None) -> dict | None:
    """The Hugging Face rope dict (without rope_theta) for `model.rope_scaling`, None for none."""
    kind = "none" if not scaling else scaling["type"]
    if kind == "none":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    for key in KEYS_BY_TYPE[kind]:
        if scaling.get(key) is not None:
            value = scaling[key]
            out[_HF_NAMES.get(key, key)] = int(value) if key == "original_max_position" else value
    return out
