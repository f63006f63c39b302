"""Weights & Biases logging (`--config.metrics.wandb=True`, README "Quickstart"): one W&B run per
launch, holding the config, the scalars TensorBoard gets (ejax.train.metrics.MetricsWriter), the eval
job's success table, plot and videos (ejax.eval.evaluate) and the rl job's learner scalars per policy
version (ejax.rl.runner).

ejax.main opens a `session` around the job. The run itself starts on the first thing logged, and
only the writers of process 0 log, so a multi-process job makes one run. A launch that resumes a
run (its workdir holds checkpoints) goes on in the W&B run of the launch before it. `wandb` is imported only
when the setting is on: it is an optional extra (pip install -e ".[wandb]").

  metrics.wandb_project, wandb_entity ("": the account's default), wandb_name ("": the workdir's
  name), wandb_mode: online (needs `wandb login` or WANDB_API_KEY) | offline (writes the run under
  <workdir>/wandb with no network; `wandb sync <that folder>` uploads it later) | disabled.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping

from ejax.errors import UserError

MODES = ("online", "offline", "disabled")
RUN_ID_FILE = "ejax_run_id"  # in <workdir>/wandb: the W&B run a resumed launch goes on in

_session: "Session | None" = None


class Session:
  """The settings of one launch's W&B run; `run` starts it on first use."""

  def __init__(self, config, workdir: str):
    metrics = config.metrics
    self.workdir = workdir
    self.settings = dict(project=metrics.get("wandb_project") or "ejax", entity=metrics.get("wandb_entity") or None,
                         name=metrics.get("wandb_name") or os.path.basename(os.path.abspath(workdir)),
                         mode=metrics.get("wandb_mode", "online"), job_type=config.get("job", "train"))
    self.config = json.loads(config.to_json_best_effort())
    self._run = None

  def run(self):
    if self._run is None:
      import wandb
      os.makedirs(os.path.join(self.workdir, "wandb"), exist_ok=True)
      resumed = self._resumed_run_id()
      try:
        self._run = wandb.init(dir=self.workdir, config=self.config, id=resumed, resume="allow" if resumed else None,
                               **self.settings)
      except Exception as error:  # wandb's errors (no API key, no network) name themselves in their text
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise UserError(f"metrics.wandb: cannot start the W&B run ({reason}): run `wandb login` or set "
                        "WANDB_API_KEY, or log with --config.metrics.wandb_mode=offline (upload later with "
                        "`wandb sync`)") from None
      with open(self._id_path, "w") as file:
        file.write(self._run.id)
    return self._run

  @property
  def _id_path(self) -> str:
    return os.path.join(self.workdir, "wandb", RUN_ID_FILE)

  def _resumed_run_id(self) -> str | None:
    """The W&B run id of the run this launch resumes (the workdir holds its checkpoints), so that a
    resumed training goes on in the same W&B run; None for a new one."""
    resuming = any(name.isdigit() for folder in ("checkpoints", "rl_checkpoints")
                   if os.path.isdir(os.path.join(self.workdir, folder))
                   for name in os.listdir(os.path.join(self.workdir, folder)))
    if resuming and os.path.isfile(self._id_path):
      return open(self._id_path).read().strip() or None
    return None

  def finish(self, exit_code: int) -> None:
    if self._run is not None:
      self._run.finish(exit_code=exit_code)
      self._run = None


@contextlib.contextmanager
def session(config, workdir: str) -> Iterator[Session | None]:
  """Around a job: W&B logging as config.metrics says (None when off); the run, if one started,
  finishes when the job ends, marked failed when it raised."""
  global _session
  metrics = config.get("metrics") or {}
  if not metrics.get("wandb", False):
    yield None
    return
  _session = Session(config, workdir)
  exit_code = 1
  try:
    yield _session
    exit_code = 0
  finally:
    current, _session = _session, None
    current.finish(exit_code)


def active_run():
  """The W&B run of this launch (started now if it has not yet), or None when W&B logging is off."""
  return _session.run() if _session is not None else None


def log_scalars(step: int, scalars: Mapping[str, float]) -> None:
  run = active_run()
  if run is not None:
    run.log(dict(scalars), step=step)


def log(values: Mapping[str, Any]) -> None:
  """Logs `values` (scalars, wandb.Table, wandb.Video, ...) at the run's next step."""
  run = active_run()
  if run is not None:
    run.log(dict(values))
