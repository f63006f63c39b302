"""The arg string of a config file: `configs/groot.py:runlocal,steps=20`."""

from __future__ import annotations

import ast

from ml_collections import ConfigDict


def parse_arg(arg: str | None, **defaults) -> ConfigDict:
  """Parses 'flag,key=value,...' over `defaults`; a bare word sets a boolean default to True.

  Values are Python literals where they parse as one ("3", "1e-4", "True"), else strings.
  Unknown keys are an error naming the accepted ones, so a typo never silently does nothing.
  """
  result = ConfigDict(defaults)
  for item in filter(None, (part.strip() for part in (arg or "").split(","))):
    key, sep, raw = item.partition("=")
    if key not in defaults:
      raise ValueError(f"config arg {key!r} is not one of: {', '.join(sorted(defaults)) or '(none)'}")
    if not sep:
      value = True
    else:
      try:
        value = ast.literal_eval(raw)
      except (ValueError, SyntaxError):
        value = raw
    result[key] = type(defaults[key])(value) if defaults[key] is not None else value
  return result
