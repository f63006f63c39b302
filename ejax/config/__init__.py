"""Config helpers shared by configs/*.py and the launcher."""

from ejax.config.args import parse_arg
from ejax.config.validate import ConfigError, validate

__all__ = ["ConfigError", "parse_arg", "validate"]
