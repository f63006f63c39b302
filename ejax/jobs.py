"""The jobs `python -m ejax.main` can run, as import paths resolved only when chosen.

Each job is a function `run_job(config: ml_collections.ConfigDict, workdir: str) -> None`. Lazy
import keeps `ejax.main` fast and lets a job's heavy dependencies (MuJoCo, TFDS) load only when used.
"""

from __future__ import annotations

from typing import Callable

from ejax.config.lazy import load_entry

JOBS: dict[str, str] = {
    "train": "ejax.train.loop:run_job",
    "summary": "ejax.models.summary:run_job",
    "convert": "ejax.models.io.convert:run_job",
    "stats": "ejax.data.stats:run_job",
    "demos": "ejax.sim.demos:run_job",
    "eval": "ejax.eval.evaluate:run_job",
    "rl": "ejax.rl.runner:run_job",
    "serve": "ejax.serve.server:run_job",
    "encode": "ejax.train.encode:run_job",      # DreamZero's frozen-encoder outputs cached ahead (issue 32)
}


def get_job(name: str) -> Callable:
  return load_entry(JOBS, name, "job", "--config.job")
