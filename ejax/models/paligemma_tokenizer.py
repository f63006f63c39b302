"""PaliGemma's sentencepiece tokenizer and pi0.5's prompt format (task text + discretised state).

pi0.5 writes the robot state into the language prompt as 256-bin integers of the normalised state:
"Task: pick up the cup, State: 12 200 128;\nAction: " (openpi tokenizer.py, `PaligemmaTokenizer`).
The model file is the released `paligemma_tokenizer.model`, read from a local path: nothing is
downloaded. Prompts are returned unpadded: packing (ejax/data/packing.py) removes padding entirely.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ejax.errors import MissingFileError

STATE_BINS = 256


def discretize_state(state: np.ndarray, num_bins: int = STATE_BINS) -> np.ndarray:
  """Normalised state in [-1, 1] -> integer bins 0..num_bins-1 (openpi's np.digitize rule).

  Values outside [-1, 1] land in the first or last bin.
  """
  bins = np.linspace(-1.0, 1.0, num_bins + 1)[:-1]
  return np.clip(np.digitize(np.asarray(state, np.float64), bins) - 1, 0, num_bins - 1)


def pi05_prompt(task: str, state: np.ndarray | None) -> str:
  """The prompt text: "Task: <task>, State: <bins>;\\nAction: " (state omitted when None)."""
  cleaned = task.strip().replace("_", " ").replace("\n", " ")
  if state is None:
    return f"Task: {cleaned};\nAction: "
  state_text = " ".join(str(int(b)) for b in discretize_state(np.ravel(state)))
  return f"Task: {cleaned}, State: {state_text};\nAction: "


def build_tokenizer(path: str, tasks: list[str], *, vocab_size: int = 400, state_dim: int = 8,
                    samples_per_task: int = 50, seed: int = 0) -> str:
  """Trains a small sentencepiece model on pi0.5 prompts of `tasks` and writes it to `path`.

  For CPU-sized runs on ejax.sim's suites, where the released paligemma_tokenizer.model is not
  available (nothing is downloaded): same format (BPE, BOS 2, EOS 1, PAD 0, UNK 3), every state bin
  "0".."255" a symbol of its own, so prompts of any state tokenise. Written atomically; -> path.
  """
  import io

  import sentencepiece

  rng = np.random.default_rng(seed)
  corpus = [pi05_prompt(task, rng.uniform(-1, 1, state_dim)) for task in tasks for _ in range(samples_per_task)]
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus), model_writer=model, vocab_size=vocab_size, model_type="bpe",
      user_defined_symbols=[str(i) for i in range(STATE_BINS)], bos_id=2, eos_id=1, pad_id=0, unk_id=3,
      minloglevel=2)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  partial = f"{path}.partial-{os.getpid()}"
  with open(partial, "wb") as f:
    f.write(model.getvalue())
  os.replace(partial, path)
  return path


LOCAL_TOKENIZER_VERSION = 1  # bump when build_tokenizer's settings change


def local_tokenizer(instructions: list[str], name: str) -> str:
  """A local tokenizer of pi0.5 prompts of `instructions`, built once into $EJAX_CACHE_DIR (default
  ~/.cache/ejax)/tokenizers/<name>-v<version>-<digest of the instructions>.model and reused: what a
  pi0.5 run on ejax.sim's recorded demonstrations tokenises with when no tokenizer_path is given (the
  instructions from the data layer, ejax.data.tasks). -> its path."""
  digest = hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:12]
  cache = os.path.expanduser(os.environ.get("EJAX_CACHE_DIR", "~/.cache/ejax"))
  path = os.path.join(cache, "tokenizers", f"{name}-v{LOCAL_TOKENIZER_VERSION}-{digest}.model")
  if not os.path.exists(path):
    build_tokenizer(path, instructions, state_dim=16)
  return path


def sim_suites_tokenizer() -> str:
  """local_tokenizer of every ejax.sim task's instruction (the recorded demonstrations' vocabulary, as
  the data layer gives it: ejax.data.tasks; a model never imports the simulator). -> its path."""
  from ejax.data.tasks import simulator_instructions
  return local_tokenizer(simulator_instructions(), "sim_suites")


class PaligemmaTokenizer:
  """Sentencepiece tokenizer loaded from a local `.model` file."""

  def __init__(self, model_path: str, *, max_len: int = 200):
    import sentencepiece  # Lazy: only input assembly needs it.

    if not os.path.exists(model_path):
      raise MissingFileError(
          f"PaliGemma tokenizer model {model_path!r} not found: copy paligemma_tokenizer.model to "
          "this path (it is big_vision's / openpi's released file) or set config.model.tokenizer_path")
    with open(model_path, "rb") as f:
      self._processor = sentencepiece.SentencePieceProcessor(model_proto=f.read())
    self.max_len = max_len

  @property
  def vocab_size(self) -> int:
    return int(self._processor.get_piece_size())

  def encode(self, text: str, *, add_bos: bool = True) -> np.ndarray:
    return np.asarray(self._processor.encode(text, add_bos=add_bos), np.int32)

  def decode(self, ids) -> str:
    return self._processor.decode([int(i) for i in ids])

  def tokenize_prompt(self, task: str, state: np.ndarray | None) -> np.ndarray:
    """Token ids [len] (BOS first) of pi0.5's prompt; error past `max_len` instead of silent cut."""
    ids = self.encode(pi05_prompt(task, state), add_bos=True)
    if len(ids) > self.max_len:
      raise ValueError(
          f"pi0.5 prompt has {len(ids)} tokens > max_len {self.max_len} (task {task[:60]!r}): raise "
          "config.model.max_token_len or shorten the task text")
    return ids
