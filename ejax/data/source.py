"""What every dataset reader shares: random access by global step, and the bad-sample policy."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ejax.data.errors import DataError

BAD_SAMPLE_POLICIES = ("error", "skip")
DEFAULT_SKIP_LIMIT = 100  # bad samples in a row after which "skip" gives up
_LOGGED_ONE_BY_ONE = 5    # skipped samples logged individually before the rate limit starts
_SUMMARY_EVERY_S = 30.0   # then at most one summary line per this many seconds
_SKIP_LOCK = threading.Lock()  # module-level: sources are pickled to grain workers, locks cannot be


class SampleSource:
  """Subclasses define `__len__` and `_sample(index)`, and call `_set_bad_sample_policy` first.

  With on_bad_sample="skip" a sample whose files are bad is counted, logged and returned as None
  (the pipeline filters it out) instead of stopping the run; `skip_limit` bad samples in a row
  mean the dataset (or the config pointing at it) is broken, not a few of its files: the run stops
  with one line rather than skipping forever. The first few skips are logged one by one, then one
  summary line per 30 s at most.
  """

  unit = "step"  # what one index is called in messages

  def _set_bad_sample_policy(self, on_bad_sample: str, skip_limit: int = DEFAULT_SKIP_LIMIT) -> None:
    if on_bad_sample not in BAD_SAMPLE_POLICIES:
      raise ValueError(f"on_bad_sample={on_bad_sample!r}: use 'error' or 'skip'")
    self.on_bad_sample = on_bad_sample
    self.skip_limit = int(skip_limit)
    self.skipped = 0  # samples skipped in this process
    self._bad_in_a_row = 0
    self._last_summary = (time.monotonic(), 0)  # (when, skipped then)

  def __getitem__(self, index: int) -> dict[str, Any] | None:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"{self.unit} {index} is outside the dataset's {len(self)} {self.unit}s")
    try:
      sample = self._sample(index)
    except DataError as error:
      if self.on_bad_sample == "error":
        raise
      self._skip(index, error)
      return None
    self._bad_in_a_row = 0
    return sample

  def _skip(self, index: int, error: DataError) -> None:
    with _SKIP_LOCK:
      self.skipped += 1
      self._bad_in_a_row += 1
      skipped, in_a_row = self.skipped, self._bad_in_a_row
      summary_due = time.monotonic() - self._last_summary[0] >= _SUMMARY_EVERY_S
      since = skipped - self._last_summary[1]
      if skipped > _LOGGED_ONE_BY_ONE and summary_due:
        self._last_summary = (time.monotonic(), skipped)
    if in_a_row >= self.skip_limit:
      raise DataError(f"gave up after {in_a_row} bad {self.unit}s in a row under data.on_bad_sample=skip "
                      f"({skipped} skipped in all): the dataset or data.path / data.cameras is wrong, not a few "
                      f"files (raise data.skip_limit if it is); the last: {error}") from None
    if skipped <= _LOGGED_ONE_BY_ONE:
      logging.warning("skipping %s %d (%d skipped so far in this process): %s", self.unit, index, skipped, error)
    elif summary_due:
      logging.warning("skipped %d %ss so far in this process (%d since the last report); the latest, %s %d: %s",
                      skipped, self.unit, since, self.unit, index, error)

  def _sample(self, index: int) -> dict[str, Any]:
    raise NotImplementedError

  def describe(self, index: int) -> str:
    """Where sample `index` comes from, for messages ("frame 57 (episode 3, file ...)")."""
    return f"{self.unit} {index}"
