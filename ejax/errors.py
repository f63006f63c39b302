"""Errors caused by the user's input (config, devices, paths, files), as opposed to bugs.

`python -m ejax.main` prints these as one line naming the problem and the fix, with no traceback;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
  """Bad input: the message names the thing that is wrong and what to do."""


class BatchError(UserError, ValueError):
  """Samples that do not fit the model's input settings (packed row length, cameras, horizon,
  state room), found while assembling a batch. A ValueError too, for library callers."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or directory the settings name (a tokenizer, a checkpoint, statistics) is not there. A
  FileNotFoundError too, for library callers."""
