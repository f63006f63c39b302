"""What every dataset reader shares: random access by global step, and the bad-sample policy."""

from __future__ import annotations

import logging
from typing import Any

from ejax.data.errors import DataError

BAD_SAMPLE_POLICIES = ("error", "skip")


class SampleSource:
  """Subclasses define `__len__` and `_sample(index)`, and call `_set_bad_sample_policy` first.

  With on_bad_sample="skip" a sample whose files are bad is counted, logged and returned as None
  (the pipeline filters it out) instead of stopping the run.
  """

  unit = "step"  # what one index is called in messages

  def _set_bad_sample_policy(self, on_bad_sample: str) -> None:
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
      raise ValueError(f"on_bad_sample={on_bad_sample!r}: use 'error' or 'skip'")
    self.on_bad_sample = on_bad_sample
    self.skipped = 0  # samples skipped in this process

  def __getitem__(self, index: int) -> dict[str, Any] | None:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"{self.unit} {index} is outside the dataset's {len(self)} {self.unit}s")
    try:
      return self._sample(index)
    except DataError as error:
      if self.on_bad_sample == "error":
        raise
      self.skipped += 1
      logging.warning("skipping %s %d (%d skipped so far in this process): %s", self.unit, index,
                      self.skipped, error)
      return None

  def _sample(self, index: int) -> dict[str, Any]:
    raise NotImplementedError

  def describe(self, index: int) -> str:
    """Where sample `index` comes from, for messages ("frame 57 (episode 3, file ...)")."""
    return f"{self.unit} {index}"
