"""Import an object by "module:attribute" only when it is used (tables of jobs and models)."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from ejax.config.validate import ConfigError


def load_entry(table: Mapping[str, str], name: str, what: str, setting: str) -> Any:
  """table[name] is "module:attribute"; an unknown name is an error listing the known ones."""
  if name not in table:
    raise ConfigError(f"unknown {what} {name!r}: set {setting} to one of {', '.join(sorted(table))}")
  module_name, attribute = table[name].split(":")
  return getattr(importlib.import_module(module_name), attribute)
