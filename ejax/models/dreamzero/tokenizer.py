"""The instruction as umT5 token ids, as the official DreamZero collate tokenises it (HuggingFace
google/umt5-xxl: whitespace cleaned, </s> appended, padded to 512 with a mask).

config.model.tokenizer_path names umT5's tokenizer.json (the `tokenizers` package reads it; nothing is
downloaded); left empty, UTF-8 bytes stand in (byte + 3 after T5's pad 0, </s> 1, <unk> 2), which is
what the CPU-sized model trains with from scratch. Never pair the bytes with released weights.
"""

from __future__ import annotations

import os
import re

import numpy as np

from ejax.errors import MissingFileError

PAD, EOS = 0, 1
BYTE_OFFSET = 3


def clean(text: str) -> str:
  return re.sub(r"\s+", " ", str(text)).strip()


class ByteTokenizer:
  def __init__(self, vocab_size: int):
    if vocab_size < 256 + BYTE_OFFSET:
      raise ValueError(f"error: byte tokens need a text vocabulary of at least {256 + BYTE_OFFSET}, "
                       f"model.text.vocab_size is {vocab_size}: raise it or set model.tokenizer_path")
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in clean(text).encode("utf-8")] + [EOS]


class UMT5Tokenizer:
  def __init__(self, path: str):
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise MissingFileError(f"umT5 tokenizer {path!r} does not exist: set config.model.tokenizer_path to a local "
                              "tokenizer.json (google/umt5-xxl's), or leave it empty for byte tokens at CPU size")
    from tokenizers import Tokenizer
    self._tokenizer = Tokenizer.from_file(path)

  def encode(self, text: str) -> list[int]:
    return list(self._tokenizer.encode(clean(text), add_special_tokens=True).ids)


def load_tokenizer(path: str, vocab_size: int):
  return UMT5Tokenizer(path) if path else ByteTokenizer(vocab_size)


def tokenize(tokenizer, texts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [n, length], mask bool [n, length]): truncated to `length` (keeping </s> last), padded."""
  ids = np.full((len(texts), length), PAD, np.int32)
  for i, text in enumerate(texts):
    tokens = tokenizer.encode(text)
    if len(tokens) > length:
      tokens = tokens[:length - 1] + [tokens[-1]]
    ids[i, :len(tokens)] = tokens
  return ids, ids != PAD
