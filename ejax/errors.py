"""Errors caused by the user's input (config, devices, paths, files), as opposed to bugs.

`python -m ejax.main` prints these as one line naming the problem and the fix, with no traceback;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
  """Bad input: the message names the thing that is wrong and what to do."""
