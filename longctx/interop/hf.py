"""Hugging Face checkpoints <-> longctx parameters.

Supported: `LlamaForCausalLM` (Llama 2, 3, 3.1), `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `Gemma3ForCausalLM` (text) and `Olmo3ForCausalLM` (longctx/interop/families.py:
each family's block options, layer types and RoPE per type), float32 / bfloat16 / float16 weights,
tied or untied embeddings, GQA, RoPE plain / linear / llama3 / YaRN, sliding windows. Anything
else (another architecture, biases, another activation, another rope type, experts, vision
towers) is refused with one sentence naming the file and key.

Tensor layout. Hugging Face stores every projection as a torch Linear weight [out, in]; longctx
stores [in, out...] with the heads split out, and the layers stacked on a leading axis:

  HF (per layer i: model.layers.{i}.*)          longctx params            from HF
  model.embed_tokens.weight        [v, d]       embed        [v, d]       as is
  self_attn.q_proj.weight          [n*h, d]     blocks/wq    [L, d, n, h] transpose, split heads
  self_attn.k_proj / v_proj.weight [k*h, d]     blocks/wk,wv [L, d, k, h] transpose, split heads
  self_attn.o_proj.weight          [d, n*h]     blocks/wo    [L, n, h, d] transpose, split heads
  mlp.gate_proj / up_proj.weight   [f, d]       blocks/w_gate, w_up [L, d, f]   transpose
  mlp.down_proj.weight             [d, f]       blocks/w_down [L, f, d]   transpose
  input_layernorm / post_attention_layernorm    blocks/attn_norm, mlp_norm [L, d]
  model.norm.weight                [d]          final_norm   [d]
  lm_head.weight                   [v, d]       unembed      [d, v]       transpose (absent if tied)

The block options add (`per_layer_tensors`): q/k/v_proj.bias [n*h] -> bq, bk, bv [L, n, h];
self_attn.q_norm / k_norm.weight [h] (per head) or [n*h] (OLMo's whole projection) -> q_norm,
k_norm; and the norms by model.norm_position: post (OLMo) post_attention_layernorm and
post_feedforward_layernorm -> post_attn_norm, post_mlp_norm; sandwich (Gemma) input_layernorm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm -> attn_norm,
post_attn_norm, mlp_norm, post_mlp_norm. A hybrid model's layers are one stack too
(longctx/model/layer_types.py): layer i is row i of `blocks` whatever its type.

No q/k permutation is needed: HF's Llama weights already use the rotate-half RoPE convention that
`longctx.model.apply_rope` uses (Meta's original checkpoints interleave pairs; HF's conversion
script permuted them once).

Reading is lazy: each safetensors file is memory-mapped and every device's shard is cut out of the
mapped tensor by `jax.make_array_from_callback`, so the host never holds a second full copy. (The
`safetensors` package's numpy reader cannot return bfloat16, the dtype of released checkpoints,
so the files are mapped here following the format: an 8-byte header length, a JSON header of
dtype/shape/byte offsets, then the raw little-endian data.) Writing uses `safetensors.numpy`,
one shard of at most `max_shard_bytes` at a time.

Sliding windows: longctx's `attention.sliding_window=w` lets token i see keys i-w .. i (w+1 keys);
Hugging Face's `sliding_window=W` (Mistral; transformers' `sliding_window_overlay`: kv > q - W)
lets it see i-W+1 .. i (W keys). So w = W - 1, both ways.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from typing import Any, Callable, Iterator

import jax
import ml_dtypes
import numpy as np

from longctx.errors import ConfigError, MissingFileError
from longctx.interop import families, staging
from longctx.model import block_options
from longctx.model import rope as rope_lib

ARCHITECTURES = {name: family.model_type for name, family in families.FAMILIES.items()}
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                np.dtype(np.float16): "float16"}
# Buffers some older checkpoints carry: recomputed from the config, never parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# longctx parameter -> (HF tensor name, number of leading longctx axes that are HF's "in" axis;
# 0 = same layout; FLAT: HF holds it as one vector). For layer parameters the name is the suffix
# after "model.layers.{i}.".
FLAT = -1
TOP_LEVEL = {"embed": ("model.embed_tokens.weight", 0), "final_norm": ("model.norm.weight", 0),
             "unembed": ("lm_head.weight", 1)}
PER_LAYER = {
    "attn_norm": ("input_layernorm.weight", 0),
    "wq": ("self_attn.q_proj.weight", 1),
    "wk": ("self_attn.k_proj.weight", 1),
    "wv": ("self_attn.v_proj.weight", 1),
    "wo": ("self_attn.o_proj.weight", 2),
    "mlp_norm": ("post_attention_layernorm.weight", 0),
    "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1),
    "w_down": ("mlp.down_proj.weight", 1),
}
_NORMS_AFTER = {"post": {"post_attn_norm": ("post_attention_layernorm.weight", 0),
                         "post_mlp_norm": ("post_feedforward_layernorm.weight", 0)},
                "sandwich": {"attn_norm": ("input_layernorm.weight", 0),
                             "post_attn_norm": ("post_attention_layernorm.weight", 0),
                             "mlp_norm": ("pre_feedforward_layernorm.weight", 0),
                             "post_mlp_norm": ("post_feedforward_layernorm.weight", 0)}}


def per_layer_tensors(model_config) -> dict[str, tuple[str, int]]:
    """{longctx block parameter: (HF suffix, in_axes)} for the block options of `model_config`."""
    o = block_options.options(model_config)
    out = {k: v for k, v in PER_LAYER.items() if k not in ("attn_norm", "mlp_norm")}
    out.update(_NORMS_AFTER.get(o.norm_position, {k: PER_LAYER[k] for k in ("attn_norm", "mlp_norm")}))
    if o.qkv_bias:
        out.update({f"b{x}": (f"self_attn.{x}_proj.bias", FLAT) for x in "qkv"})
    if o.qk_norm != "none":
        out.update({f"{x}_norm": (f"self_attn.{x}_norm.weight", FLAT) for x in "qk"})
    return out


# ----------------------------------------------------------------------------- config.json


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} does not exist; a Hugging Face checkpoint directory holds "
                               "config.json and model.safetensors (or model.safetensors.index.json).")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg}).") from None


def rope_settings(hf: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, longctx rope_scaling values) from either spelling of config.json."""
    params = hf.get("rope_parameters")
    if params:
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(f"{where}: rope_parameters per layer type is not supported (one RoPE for all layers).")
        theta, scaling = params.get("rope_theta", hf.get("rope_theta")), params
    else:
        theta, scaling = hf.get("rope_theta"), hf.get("rope_scaling")
    partial = (params or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial} is not supported (RoPE on the whole head).")
    return float(10_000.0 if theta is None else theta), rope_lib.from_hf(
        scaling, hf.get("max_position_embeddings"), where)


def config_overrides(hf: dict, where: str = CONFIG_FILE) -> dict[str, Any]:
    """The longctx config values (dotted keys) that describe the model in a HF config.json
    (longctx/interop/families.py)."""
    return families.config_overrides(hf, where)


def print_overrides(overrides: dict[str, Any], base=None) -> str:
    """`--config.KEY=VALUE` flags for the values that differ from `base` (all if None)."""
    lines = []
    for key, value in overrides.items():
        if base is not None:
            node = base
            for part in key.split("."):
                node = node.get(part) if hasattr(node, "get") else None
            if (node.to_dict() if hasattr(node, "to_dict") else node) == value:
                continue
        # (a dict, attention.layer_types, as one Python literal the flag parser reads, quoted for the shell)
        flag = f"--config.{key}={value}"
        lines.append((f'"{flag}"' if not set('"$`\\') & set(flag) else shlex.quote(flag))
                     if isinstance(value, dict) else flag)
    return " \\\n".join(lines)


def _max_position_embeddings(hf_rope: dict | None, template: int | None, seq_len: int) -> int:
    """config.json's max_position_embeddings for the exported RoPE.

    YaRN: exactly round(factor x original_max_position_embeddings). transformers 4.4x-4.5x read
    YaRN's factor back as max_position_embeddings / original_max_position_embeddings (ignoring
    `factor`), and later versions warn when the two disagree; any other value (the template's, or
    a longer training length) would make transformers compute other frequencies than the model
    was trained with. Otherwise (llama3, linear, none) transformers does not derive the
    frequencies from it: the longest of the template's, factor x original (llama3 wants it above
    the original) and the training length."""
    if hf_rope and hf_rope["rope_type"] == "yarn":
        return int(round(hf_rope["factor"] * hf_rope["original_max_position_embeddings"]))
    longest = max(int(template or 0), int(seq_len))
    if hf_rope and "original_max_position_embeddings" in hf_rope:
        longest = max(longest, int(round(hf_rope["factor"] * hf_rope["original_max_position_embeddings"])))
    return longest


def export_config(config, dtype: np.dtype, template: dict | None = None) -> dict:
    """A HF config.json for the longctx model in `config` (longctx/interop/families.py). `template`
    (the source model's config.json) keeps the fields longctx does not know (token ids, ...)."""
    return families.export_config(config, _DTYPE_NAMES[np.dtype(dtype)], _max_position_embeddings, template)


# ----------------------------------------------------------------------------- safetensors files


def ignored_index(directory: str) -> bool:
    """Whether `directory` holds both model.safetensors and an index (SafetensorsFiles reads the
    former, as transformers does; the index is most likely another export's)."""
    return all(os.path.isfile(os.path.join(directory, f)) for f in (SINGLE_FILE, INDEX_FILE))


class SafetensorsFiles:
    """The tensors of a HF checkpoint directory (one file or an index of shards), memory-mapped."""

    def __init__(self, directory: str):
        self.directory = directory
        index, single = os.path.join(directory, INDEX_FILE), os.path.join(directory, SINGLE_FILE)
        # transformers' precedence (`from_pretrained` of a local directory, 4.x and 5.x): the single
        # model.safetensors first, the index only when there is none. A directory holding both
        # (e.g. exports of different sizes written into one place) is read as transformers reads it.
        if os.path.isfile(single):
            files = [SINGLE_FILE]
        elif os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e}).") from None
            files = sorted(set(weight_map.values()))
        else:
            raise MissingFileError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} (weights in "
                                   "pytorch_model.bin must be saved as safetensors first).")
        self._entries: dict[str, tuple[str, str, list[int], int, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        for name in files:
            self._read_header(os.path.join(directory, name))

    def _read_header(self, path: str) -> None:
        if not os.path.isfile(path):
            raise MissingFileError(f"{path} is listed in {INDEX_FILE} but does not exist.")
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= size - 8:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not a safetensors file ({e}).") from None
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if 8 + n + end > size:
                raise ConfigError(f"{path} is truncated: tensor {name} ends past the end of the file.")
            self._entries[name] = (path, entry["dtype"], list(entry["shape"]), 8 + n + begin, 8 + n + end)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2])

    def array(self, name: str) -> np.ndarray:
        """A read-only view of the mapped tensor (pages are read when touched)."""
        path, dtype, shape, begin, end = self._entries[name]
        if dtype not in DTYPES:
            raise ConfigError(f"{path}: tensor {name} has dtype {dtype}; longctx reads {', '.join(DTYPES)}.")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][begin:end].view(DTYPES[dtype]).reshape(shape)


def _hf_shape(shape: tuple[int, ...], in_axes: int) -> tuple[int, ...]:
    """HF's [out, in] shape of a longctx parameter whose first `in_axes` axes are the input."""
    if in_axes == 0:
        return tuple(shape)
    if in_axes == FLAT:
        return (math.prod(shape),)
    return (math.prod(shape[in_axes:]), math.prod(shape[:in_axes]))


def _to_longctx(hf_tensor: np.ndarray, shape: tuple[int, ...], in_axes: int) -> np.ndarray:
    """A view of a HF tensor in longctx's layout (transpose and reshape of a view copy nothing)."""
    if in_axes == FLAT:
        return hf_tensor.reshape(shape)
    return hf_tensor if in_axes == 0 else hf_tensor.T.reshape(shape)


def _from_longctx(value: np.ndarray, in_axes: int) -> np.ndarray:
    if in_axes == 0:
        return value
    if in_axes == FLAT:
        return value.reshape(-1)
    return np.ascontiguousarray(value.reshape(math.prod(value.shape[:in_axes]), -1).T)


def _param_name(path) -> tuple[str, ...]:
    """("blocks", "wq") for the key path of a parameter leaf (…/value dropped)."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if name is not None and name != "value":
            names.append(str(name))
    return tuple(names)


def _tensor_plan(names: tuple[str, ...], config):
    """[(HF name, row of the layer stack or None)] and in_axes for one longctx parameter."""
    if names[:-1] == ("blocks",):
        tensors = per_layer_tensors(config.model)
        if names[-1] not in tensors:
            raise ConfigError(f"longctx parameter {'/'.join(names)} has no Hugging Face equivalent "
                              "(attention sinks cannot be converted).")
        suffix, in_axes = tensors[names[-1]]
        return [(f"model.layers.{layer}.{suffix}", layer) for layer in range(config.model.num_layers)], in_axes
    hf_name, in_axes = TOP_LEVEL[names[0]]
    return [(hf_name, None)], in_axes


def _check_tensors(files: SafetensorsFiles, abstract_params, config, where: str) -> None:
    """Every tensor the model needs exists with the shape config.json implies, and nothing else is there."""
    expected: dict[str, tuple[int, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        plan, in_axes = _tensor_plan(_param_name(path), config)
        shape = leaf.shape[1:] if plan[0][1] is not None else leaf.shape
        for name, _ in plan:
            expected[name] = _hf_shape(shape, in_axes)
    for name, shape in expected.items():
        if name not in files:
            raise ConfigError(f"{where} has no tensor {name} (config.json describes "
                              f"{config.model.num_layers} layers, tie_word_embeddings="
                              f"{str(config.model.tie_embeddings).lower()}).")
        if files.shape(name) != shape:
            raise ConfigError(f"{where}: tensor {name} has shape {list(files.shape(name))} but config.json "
                              f"implies {list(shape)}.")
    ignorable = {"lm_head.weight"} if config.model.tie_embeddings else set()
    extra = [n for n in files.names() if n not in expected and n not in ignorable
             and not n.endswith(_IGNORED_SUFFIXES)]
    if extra:
        raise ConfigError(f"{where} holds tensor {extra[0]}, which the model described by config.json "
                          f"does not have ({len(extra)} such tensor(s)).")


def load_params(hf_directory: str, config, abstract_params, shardings):
    """longctx parameters (the tree of `abstract_params`, each leaf sharded by `shardings`) read
    lazily from a HF checkpoint directory, cast to `model.param_dtype`."""
    files = SafetensorsFiles(hf_directory)
    _check_tensors(files, abstract_params, config, hf_directory)

    def build(path, leaf, sharding):
        plan, in_axes = _tensor_plan(_param_name(path), config)
        stacked = plan[0][1] is not None
        shape = leaf.shape[1:] if stacked else leaf.shape

        def shard(index):
            # Only this device's slice is copied out of the mapped file (and cast).
            if not stacked:
                return np.asarray(_to_longctx(files.array(plan[0][0]), shape, in_axes)[index], leaf.dtype)
            layers = range(len(plan))[index[0]]
            return np.stack([np.asarray(_to_longctx(files.array(plan[i][0]), shape, in_axes)[index[1:]],
                                        leaf.dtype) for i in layers])

        return jax.make_array_from_callback(leaf.shape, sharding, shard)

    return jax.tree_util.tree_map_with_path(build, abstract_params, shardings)


# ----------------------------------------------------------------------------- export


def exported_tensors(params, config) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """[(HF name, HF shape, read)] in HF's order; `read()` fetches one tensor to the host."""
    by_name = {_param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    out = []

    def add(names, hf_name, layer, in_axes):
        leaf = by_name[names]
        shape = leaf.shape[1:] if layer is not None else leaf.shape
        read = (lambda: _from_longctx(np.asarray(jax.device_get(leaf if layer is None else leaf[layer])), in_axes))
        out.append((hf_name, _hf_shape(shape, in_axes), read))

    add(("embed",), TOP_LEVEL["embed"][0], None, 0)
    for i in range(config.model.num_layers):
        for key, (suffix, in_axes) in per_layer_tensors(config.model).items():
            add(("blocks", key), f"model.layers.{i}.{suffix}", i, in_axes)
    add(("final_norm",), TOP_LEVEL["final_norm"][0], None, 0)
    if not config.model.tie_embeddings:
        add(("unembed",), TOP_LEVEL["unembed"][0], None, 1)
    return out


def _shard_groups(tensors, itemsize: int, max_shard_bytes: int) -> list[list]:
    groups, size = [[]], 0
    for entry in tensors:
        nbytes = math.prod(entry[1]) * itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


def write_hf(params, config, directory: str, *, dtype, template: dict | None = None,
             max_shard_bytes: int = 5 << 30, overwrite: bool = False) -> list[str]:
    """Writes config.json and safetensors shards (with an index when there are several) that
    `transformers` loads; returns the files written. One shard's tensors are on the host at a time.

    A non-empty `directory` is refused unless `overwrite`; the files are written into a sibling
    directory that then replaces `directory` whole (longctx/interop/staging.py), so no file of an older
    export is left beside the new ones and a failed export leaves the old one as it was."""
    if jax.process_count() > 1:
        raise ConfigError("export to Hugging Face runs in one process (it gathers each tensor to the host).")
    dtype = np.dtype(dtype)
    hf_config = export_config(config, dtype, template)
    with staging.staged(directory, overwrite) as out:
        return _write_files(params, config, out, dtype, hf_config, max_shard_bytes)


def _write_files(params, config, directory: str, dtype: np.dtype, hf_config: dict,
                 max_shard_bytes: int) -> list[str]:
    from safetensors.numpy import save_file  # lazily: only an export writes safetensors

    tensors = exported_tensors(params, config)
    groups = _shard_groups(tensors, dtype.itemsize, max_shard_bytes)
    names = ([SINGLE_FILE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for file_name, group in zip(names, groups):
        arrays = {}
        for hf_name, _, read in group:
            arrays[hf_name] = read().astype(dtype)
            weight_map[hf_name] = file_name
            total += arrays[hf_name].nbytes
        save_file(arrays, os.path.join(directory, file_name), metadata={"format": "pt"})
        del arrays
    written = list(names)
    if len(groups) > 1:
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX_FILE)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)
    return written + [CONFIG_FILE]


def iter_hf_tensors(directory: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, mapped array) of every tensor in a HF directory, sorted by name (tests, checks)."""
    files = SafetensorsFiles(directory)
    for name in files.names():
        yield name, files.array(name)
