"""Tokenizers: the byte-level default and SentencePiece.

A tokenizer is named by a *spec* string, the same one the CLI takes and `metadata.json` records:
  "byte"                   ids 0..255 are the UTF-8 bytes, then BOS=256, EOS=257, PAD=258 (vocab 259)
  "sentencepiece:MODEL"    a SentencePiece model file; BOS/EOS/PAD come from the model

Every document is stored as `BOS + tokens + EOS`, so the model learns where documents start and
end and the first real token of a document is a prediction target (its input is BOS).
"""

from __future__ import annotations

import dataclasses
import os

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

    def encode(self, data: bytes) -> np.ndarray:
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
        if self._sp is None:
            return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")
        return self._sp.decode(ids)


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", BYTE_VOCAB + 3, BYTE_BOS, BYTE_EOS, BYTE_PAD)


def sentencepiece_tokenizer(model_path: str) -> Tokenizer:
    import sentencepiece as spm

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
    import io

    import sentencepiece as spm

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


def load_tokenizer(spec: str, data_dir: str | None = None) -> Tokenizer:
    """Tokenizer from a spec; relative SentencePiece paths resolve inside `data_dir` if given."""
    if spec == "byte":
        return byte_tokenizer()
    if spec.startswith("sentencepiece:"):
        path = spec.split(":", 1)[1]
        if data_dir is not None and not os.path.isabs(path):
            path = os.path.join(data_dir, path)
        return sentencepiece_tokenizer(path)
    raise ConfigError(f"unknown tokenizer {spec!r}; use 'byte' or 'sentencepiece:MODEL_FILE'.")
