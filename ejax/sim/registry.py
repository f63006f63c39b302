"""Task registry: `make(task_name, **overrides) -> Env`, `list_tasks(suite=None)`, the suites."""

from __future__ import annotations

from ejax.sim.env import Env
from ejax.sim.suites import SUITES, TASKS
from ejax.sim.tasks import TaskSpec

__all__ = ["SUITES", "TASKS", "get_spec", "list_tasks", "list_suites", "make"]


def list_suites() -> list[str]:
  return list(SUITES)


def list_tasks(suite: str | None = None) -> list[str]:
  """Task names, all or of one suite ("spatial", "object", "goal")."""
  if suite is None:
    return list(TASKS)
  if suite not in SUITES:
    raise ValueError(f"unknown suite {suite!r}: use one of {', '.join(SUITES)}")
  return [spec.name for spec in SUITES[suite]]


def get_spec(task_name: str) -> TaskSpec:
  if task_name not in TASKS:
    raise ValueError(f"unknown task {task_name!r}: see ejax.sim.registry.list_tasks() for the {len(TASKS)} tasks")
  return TASKS[task_name]


def make(task_name: str, **overrides) -> Env:
  """An MJX env for one task. Overrides: cameras (bool), image_size ((h, w)), episode_length."""
  return Env(get_spec(task_name), **overrides)
