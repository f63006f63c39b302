"""ejax launcher: `python -m ejax.main --config=configs/groot.py:runlocal [--config.x=y] [--workdir=DIR]`.

It parses the config, validates it, and calls the job the config names (config.job). Nothing else:
the work lives in importable libraries (see ejax/jobs.py).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from ejax.config import quiet

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, optionally with an arg: configs/groot.py:runlocal", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where checkpoints, metrics and outputs go (default: runs/<config>_<arg>).")
flags.mark_flags_as_required(["config"])


def default_workdir(config_arg: str) -> str:
  path, _, arg = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  suffix = "_" + arg.replace(",", "_").replace("=", "-") if arg else ""
  return os.path.join("runs", name + suffix)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go through --config.x=y")
  # Imported here so that `--help` stays fast and JAX starts after absl has parsed the flags.
  from ejax.config import validate
  from ejax.errors import UserError
  from ejax.jobs import get_job
  from ejax.train import rows as embodiment_rows
  from ejax.train import wandb_run

  quiet.quiet_library_logs()
  config = _CONFIG.value
  if not isinstance(config, ConfigDict):
    # config_flags returns a stand-in that raises on first use when the file failed to load.
    try:
      getattr(config, "job")
    except Exception as error:
      lines = [line.strip() for line in str(error).splitlines() if line.strip()]
      _fail(f"--config: {lines[-1] if lines else error}")
  workdir = _WORKDIR.value or default_workdir(flags.FLAGS["config"].serialize().split("=", 1)[1])
  try:
    config = embodiment_rows.resolve(config)
    validate(config)
    job = get_job(config.job)
    with wandb_run.session(config, workdir):  # config.metrics.wandb: the job's W&B run, if on
      job(config, workdir)
  except UserError as error:
    logging.flush()
    print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
    _exit_now_if_stuck(2)
    sys.exit(2)


def one_line(error: BaseException) -> str:
  """The message on one line: a library's text quoted inside it (orbax's, a file's) may hold newlines."""
  return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def _exit_now_if_stuck(code: int) -> None:
  """Exits at once when library threads would keep the process alive after its last line: after a
  failed save, orbax's save threads wait minutes for signals that never come."""
  import threading
  if any(thread.is_alive() and not thread.daemon and thread is not threading.main_thread()
         for thread in threading.enumerate()):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> None:
  quiet.quiet_xla_cpu_logs()  # before the config file (and with it jax) is imported
  quiet.quiet_optional_imports()
  # Flag-parsing problems (a missing config file, an unknown --config.key) become one line too.
  try:
    app.run(main, flags_parser=_parse_flags)
  except KeyboardInterrupt:
    sys.exit(130)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except Exception as error:  # config_flags raises several types for a bad file, arg or key
    _fail(_flag_message(error))


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def _flag_message(error: Exception) -> str:
  """One line from config_flags' errors, which wrap the real cause's traceback in their text."""
  text = str(error).strip()
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if "Traceback" in text and lines:
    # The last line is the cause, e.g. "ValueError: config arg 'runlocl' is not one of: ...".
    cause = lines[-1].split(": ", 1)[-1]
    flag = lines[0].split(":", 1)[0] if lines[0].startswith("flag ") else "--config"
    return f"{flag}: {cause}"
  if isinstance(error, (AttributeError, KeyError)):
    cleaned = text.replace("\\'", "'").replace("\\n", " ").replace("\n", " ").strip("'\" ")
    return f"unknown config key {cleaned}: check the spelling against the config file"
  return " ".join(lines) or type(error).__name__


if __name__ == "__main__":
  run()
