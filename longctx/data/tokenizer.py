"""Tokenizers: the byte-level default, SentencePiece, and Hugging Face `tokenizers`.

A tokenizer is named by a *spec* string, the same one the CLI takes and `metadata.json` records:
  "byte"                   ids 0..255 are the UTF-8 bytes, then BOS=256, EOS=257, PAD=258 (vocab 259)
  "sentencepiece:MODEL"    a SentencePiece model file; BOS/EOS/PAD come from the model
  "hf:DIR_OR_JSON"         a Hugging Face tokenizer.json (or a model directory holding one) read
                           by the `tokenizers` library; BOS/EOS/PAD are the bos_token, eos_token
                           and pad_token of the tokenizer_config.json beside it (else the ids in
                           the directory's config.json); the vocabulary includes added tokens

Every document is stored as `BOS + tokens + EOS`, so the model learns where documents start and
end and the first real token of a document is a prediction target (its input is BOS).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil

import numpy as np

from longctx.errors import ConfigError, MissingFileError

BYTE_VOCAB = 256
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text -> int32 ids; `encode_document` adds BOS/EOS."""

    name: str  # the spec recorded in metadata.json ("byte" or "sentencepiece:<file name>")
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    _sp: object = dataclasses.field(default=None, repr=False, compare=False)
    _hf: object = dataclasses.field(default=None, repr=False, compare=False)  # tokenizers.Tokenizer

    def encode(self, data: bytes) -> np.ndarray:
        if self._hf is not None:
            # Special tokens are not added here: every document gets exactly one BOS and one EOS
            # from encode_document, whatever the tokenizer's own post-processor would add.
            text = data.decode("utf-8", errors="replace")
            return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        if self._sp is None:
            return np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        # SentencePiece works on text; undecodable bytes become U+FFFD rather than failing a corpus.
        text = data.decode("utf-8", errors="replace")
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def encode_document(self, data: bytes) -> np.ndarray:
        ids = self.encode(data)
        out = np.empty(len(ids) + 2, dtype=np.int32)
        out[0], out[1:-1], out[-1] = self.bos_id, ids, self.eos_id
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) not in (self.bos_id, self.eos_id, self.pad_id)]
        if self._hf is not None:
            return self._hf.decode(ids)
        if self._sp is None:
            return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self._sp.decode(ids)


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", BYTE_VOCAB + 3, BYTE_BOS, BYTE_EOS, BYTE_PAD)


def sentencepiece_tokenizer(model_path: str) -> Tokenizer:
    import sentencepiece as spm  # lazily, as every tokenizer library: only the one a dataset names

    if not os.path.isfile(model_path):
        raise MissingFileError(f"SentencePiece model {model_path} does not exist.")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(model_path)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"{model_path} is not a readable SentencePiece model ({e}).") from None
    bos, eos, pad = sp.bos_id(), sp.eos_id(), sp.pad_id()
    if bos < 0 or eos < 0:
        raise ConfigError(f"SentencePiece model {model_path} has no BOS or EOS piece; both are needed "
                          "to mark document boundaries.")
    # Padding positions are masked out of the loss and out of attention (segment id 0), so any
    # in-vocabulary id works; EOS stands in when the model defines no PAD piece.
    pad = eos if pad < 0 else pad
    name = "sentencepiece:" + os.path.basename(model_path)
    return Tokenizer(name, sp.GetPieceSize(), bos, eos, pad, sp)


def train_sentencepiece(texts, vocab_size: int, model_path: str) -> str:
    """Trains a BPE SentencePiece model on an iterable of strings into `model_path`.

    Ids 0..3 are fixed as UNK, BOS, EOS, PAD. Training is single-threaded with a fixed seed, and
    the model is written from memory (a file prefix would be recorded inside the model), so
    re-running prepare_data on the same input gives the same model, byte for byte.
    """
    import sentencepiece as spm  # lazily: only to train a SentencePiece model

    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(0)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(texts),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,  # any byte sequence stays encodable
            normalization_rule_name="identity",  # lossless: decode(encode(text)) == text
            remove_extra_whitespaces=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. vocab_size too large for the corpus
        raise ConfigError(f"--train-sentencepiece {vocab_size}: SentencePiece training failed "
                          f"({str(e).strip()}).") from None
    with open(model_path, "wb") as f:
        f.write(buf.getvalue())
    return model_path


HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def hf_tokenizer_files(path: str) -> tuple[str, str | None]:
    """(tokenizer.json, tokenizer_config.json or None) for a spec path: a model directory or a
    tokenizer.json file (whose directory may hold the config)."""
    json_path = os.path.join(path, HF_TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(json_path):
        raise MissingFileError(f"Hugging Face tokenizer {json_path} does not exist.")
    config_path = os.path.join(os.path.dirname(json_path), HF_TOKENIZER_CONFIG)
    return json_path, config_path if os.path.isfile(config_path) else None


def _special_token_ids(tok, json_path: str, config_path: str | None) -> dict[str, int | None]:
    """bos/eos/pad ids from tokenizer_config.json (token strings, or {"content": ...}), else from
    the ids in config.json beside it."""
    found: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    if config_path is not None:
        try:
            with open(config_path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config_path} is not valid JSON ({e.msg}).") from None
        for key in found:
            token = config.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None:
                found[key] = tok.token_to_id(token)
                if found[key] is None:
                    raise ConfigError(f"{config_path}: {key}_token {token!r} is not in the vocabulary "
                                      f"of {json_path}.")
    model_config = os.path.join(os.path.dirname(json_path), "config.json")
    if (found["bos"] is None or found["eos"] is None) and os.path.isfile(model_config):
        with open(model_config) as f:
            ids = json.load(f)
        for key in ("bos", "eos", "pad"):
            value = ids.get(f"{key}_token_id")
            value = value[0] if isinstance(value, list) and value else value  # (Llama 3.1 lists several EOS)
            if found[key] is None and isinstance(value, int):
                found[key] = value
    return found


def hf_tokenizer(path: str) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer  # lazily: optional, for hf: tokenizers only
    except ImportError:
        raise ConfigError("the hf: tokenizer needs the `tokenizers` package (pip install tokenizers).") from None

    json_path, config_path = hf_tokenizer_files(path)
    try:
        tok = HFTokenizer.from_file(json_path)
    except Exception as e:  # noqa: BLE001  (the Rust library raises its own exception type)
        raise ConfigError(f"{json_path} is not a readable Hugging Face tokenizer ({e}).") from None
    ids = _special_token_ids(tok, json_path, config_path)
    if ids["bos"] is None or ids["eos"] is None:
        raise ConfigError(f"Hugging Face tokenizer {json_path} names no BOS or EOS token (bos_token / "
                          f"eos_token in {HF_TOKENIZER_CONFIG} beside it); both are needed to mark "
                          "document boundaries.")
    # As for SentencePiece: padding is masked everywhere, so EOS can stand in for a missing PAD.
    pad = ids["eos"] if ids["pad"] is None else ids["pad"]
    return Tokenizer("hf:" + os.path.basename(json_path), tok.get_vocab_size(with_added_tokens=True),
                     ids["bos"], ids["eos"], pad, _hf=tok)


def write_hf_tokenizer(path: str, out_dir: str) -> None:
    """Copies the tokenizer.json of `path` into `out_dir` with a tokenizer_config.json naming the
    BOS/EOS/PAD tokens it was read with."""
    tok = hf_tokenizer(path)  # validates before copying
    json_path, _ = hf_tokenizer_files(path)
    shutil.copyfile(json_path, os.path.join(out_dir, HF_TOKENIZER_FILE))
    special = {f"{key}_token": tok._hf.id_to_token(i)
               for key, i in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id))}
    with open(os.path.join(out_dir, HF_TOKENIZER_CONFIG), "w") as f:
        json.dump({**special, "source": os.path.abspath(json_path)}, f, indent=2, sort_keys=True)
        f.write("\n")


def load_tokenizer(spec: str, data_dir: str | None = None) -> Tokenizer:
    """Tokenizer from a spec; relative SentencePiece and hf: paths resolve inside `data_dir` if given."""
    if spec == "byte":
        return byte_tokenizer()
    for prefix, load in (("sentencepiece:", sentencepiece_tokenizer), ("hf:", hf_tokenizer)):
        if spec.startswith(prefix):
            path = spec.split(":", 1)[1]
            if data_dir is not None and not os.path.isabs(path):
                path = os.path.join(data_dir, path)
            return load(path)
    raise ConfigError(f"unknown tokenizer {spec!r}; use 'byte', 'sentencepiece:MODEL_FILE' or "
                      "'hf:TOKENIZER_JSON_OR_DIR'.")
