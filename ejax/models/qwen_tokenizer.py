"""Qwen3 BPE tokenizer from a local `tokenizer.json`, and the Eagle 2.5 prompt GR00T feeds it.

Nothing is downloaded: point `config.model.tokenizer_path` at the tokenizer.json shipped with the
checkpoint (Eagle 2.5's Qwen3 vocabulary with <img>, </img> and <IMG_CONTEXT> added).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from ejax.errors import MissingFileError

IMAGE_START = "<img>"
IMAGE_END = "</img>"
IMAGE_CONTEXT = "<IMG_CONTEXT>"


class QwenTokenizer:

  def __init__(self, tokenizer: Tokenizer):
    self._tokenizer = tokenizer

  @classmethod
  def from_file(cls, path: str) -> "QwenTokenizer":
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
      raise MissingFileError(f"Qwen tokenizer file {path!r} does not exist: set config.model.tokenizer_path to a "
                              "local tokenizer.json (no downloads at run time)")
    return cls(Tokenizer.from_file(path))

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, skip_special_tokens=False)

  def token_id(self, token: str) -> int:
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary: use the tokenizer.json of the "
                     "checkpoint (Eagle 2.5 adds <img>, </img>, <IMG_CONTEXT>)")
    return token_id


def eagle_prompt(tokenizer: QwenTokenizer, task: str, num_images: int, tokens_per_image: int,
                 image_token_id: int | None = None, text_first: bool = False) -> list[int]:
  """Token ids of Eagle 2.5's chat prompt: each image as <img> + N x <IMG_CONTEXT> + </img>, then the
  instruction, in Qwen's chat format. The image-context ids are where vision tokens go.

  text_first puts the instruction (and a newline) before the images instead: in the causal LLM the
  image tokens then attend to the instruction, so what they say can depend on which object it names.
  Released weights were trained with the images first; the option is for models trained from scratch.
  """
  context = tokenizer.token_id(IMAGE_CONTEXT) if image_token_id is None else image_token_id
  ids = tokenizer.encode("<|im_start|>user\n")
  if text_first:
    ids += tokenizer.encode(task) + tokenizer.encode("\n")
  for _ in range(num_images):
    ids += [tokenizer.token_id(IMAGE_START)] + [context] * tokens_per_image + [tokenizer.token_id(IMAGE_END)]
    ids += tokenizer.encode("\n")
  if not text_first:
    ids += tokenizer.encode(task)
  ids += tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
  return ids


class ByteTokenizer:
  """UTF-8 bytes as token ids (0-255) plus the chat/image specials after them.

  For CPU-sized runs and tests without a tokenizer file (config.model.tokenizer_path empty): the
  prompt has the same structure as with Qwen's BPE, only longer text. Never used with real weights.
  """

  SPECIALS = ("<|im_start|>", "<|im_end|>", IMAGE_START, IMAGE_END, IMAGE_CONTEXT)

  def __init__(self, vocab_size: int = 512):
    if vocab_size < 256 + len(self.SPECIALS):
      raise ValueError(f"ByteTokenizer needs a vocabulary of at least {256 + len(self.SPECIALS)}, got {vocab_size}")
    self.vocab_size = vocab_size
    self._special_ids = {token: 256 + i for i, token in enumerate(self.SPECIALS)}

  def encode(self, text: str) -> list[int]:
    ids, rest = [], text
    while rest:
      hits = [(rest.find(s), s) for s in self.SPECIALS if s in rest]
      if not hits:
        return ids + list(rest.encode("utf-8"))
      position, special = min(hits)
      ids += list(rest[:position].encode("utf-8")) + [self._special_ids[special]]
      rest = rest[position + len(special):]
    return ids

  def decode(self, ids: list[int]) -> str:
    names = {v: k for k, v in self._special_ids.items()}
    out, pending = [], bytearray()
    for i in ids:
      if i < 256:
        pending.append(i)
        continue
      out.append(pending.decode("utf-8", errors="replace"))
      pending = bytearray()
      out.append(names.get(i, f"<{i}>"))
    return "".join(out) + pending.decode("utf-8", errors="replace")

  def token_id(self, token: str) -> int:
    if token not in self._special_ids:
      raise KeyError(f"token {token!r} is not one of the byte tokenizer's specials {self.SPECIALS}")
    return self._special_ids[token]


def load_tokenizer(path: str, vocab_size: int):
  """The checkpoint's Qwen tokenizer when `path` is set, else the byte tokenizer (CPU runs)."""
  return QwenTokenizer.from_file(path) if path else ByteTokenizer(vocab_size)
