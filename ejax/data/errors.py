"""The one error type for bad dataset input, naming the file and the episode it came from."""

from __future__ import annotations

from ejax.errors import UserError


class DataError(UserError):
  """A dataset file is missing, truncated, corrupt or inconsistent with its metadata.

  The message names the file and (where known) the episode, and says what to do; `path` and
  `episode_index` carry the same facts for code that counts skipped samples.
  """

  def __init__(self, message: str, *, path: str | None = None, episode_index: int | None = None):
    where = []
    if path is not None:
      where.append(f"file {path}")
    if episode_index is not None:
      where.append(f"episode {episode_index}")
    super().__init__(f"{message} ({', '.join(where)})" if where else message)
    self.path = path
    self.episode_index = episode_index
