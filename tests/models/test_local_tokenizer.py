"""pi0.5's local tokenizer for ejax.sim's recorded demonstrations: built once from the instructions the
data layer gives (ejax.data.tasks; the tokenizer module imports no simulator), cached under a name
that says which instructions, and every simulator task's prompt tokenises without an unknown piece."""

import os

import numpy as np

from ejax.data.tasks import simulator_instructions
from ejax.models.paligemma_tokenizer import PaligemmaTokenizer, local_tokenizer, sim_suites_tokenizer


def test_sim_suites_tokenizer_is_built_once_and_covers_every_instruction(tmp_path, monkeypatch):
  monkeypatch.setenv("EJAX_CACHE_DIR", str(tmp_path))
  instructions = simulator_instructions()
  assert len(instructions) == 15 and len(set(instructions)) == 15
  path = sim_suites_tokenizer()
  assert os.path.dirname(path) == str(tmp_path / "tokenizers") and os.path.basename(path).startswith("sim_suites-v1-")
  built = os.stat(path).st_mtime_ns
  assert sim_suites_tokenizer() == path and os.stat(path).st_mtime_ns == built   # reused, not rebuilt
  tokenizer = PaligemmaTokenizer(path, max_len=64)
  unknown = 3
  for instruction in instructions:
    ids = tokenizer.tokenize_prompt(instruction, np.linspace(-1, 1, 11))
    assert ids[0] == 2 and unknown not in ids
    assert tokenizer.decode(ids[1:]).startswith("Task: " + instruction.strip().replace("_", " "))
  # other instructions: another file beside it
  other = local_tokenizer(instructions[1:], "sim_suites")
  assert other != path and os.path.exists(other)
