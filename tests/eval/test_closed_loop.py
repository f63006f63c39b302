"""Diagnostics of the closed loop train -> simulate -> assess (issue: policies must succeed in ejax.sim).

1. Oracle through the plumbing: the recorded demonstrations' action chunks, exactly as the training
   pipeline labels them (LeRobot reader, chunking, normalisation), passed through a checkpoint
   policy's output path (the model's padded action width, cut, unnormalise) and executed by the eval
   job's rollout (chunks, replan_every) on the recorded layouts, succeed as the expert did. A gap
   here is a bug in the loop, not in learning.
2. Privileged-state behaviour cloning: the RL job's state-based actor, trained on expert demos,
   reaches >= 80 % of episodes on layouts it never saw.
3. Overfit: a GR00T policy trained to near-zero loss on a handful of demos of one task succeeds on
   those same layouts.

CI runs small versions; `pytest -m slow tests/eval/test_closed_loop.py` runs the full ones.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
import jax
from ml_collections import ConfigDict

from configs import common
from ejax.data import stats as stats_lib
from ejax.data.sources import make_source
from ejax.data import transforms
from ejax.eval.evaluate import evaluate_policy
from ejax.sim import demos as demos_lib
from ejax.sim.batched import BatchedEnv
from ejax.train.policy import env_actions, policy_normalizer

pytestmark = pytest.mark.timeout(900)


def demo_settings(tasks: str, episodes: int, num_envs: int, seed: int) -> ConfigDict:
  settings = ConfigDict(common.demo_settings())
  settings.update(tasks=tasks, episodes_per_task=episodes, num_envs=num_envs, image_height=64, image_width=64,
                  seed=seed, keep_failures=True)
  return settings


def eval_settings(settings: ConfigDict, replan_every: int) -> ConfigDict:
  """The eval job's settings that replay the recorded layouts: same tasks, envs and seed."""
  return ConfigDict(dict(tasks=settings.tasks, episodes_per_task=settings.episodes_per_task,
                         num_envs=settings.num_envs, backend=settings.backend, image_height=64, image_width=64,
                         replan_every=replan_every, episode_length=0, videos_per_task=0, seed=settings.seed,
                         checkpoint=""))


class ReplayPolicy:
  """Plays back recorded episodes through the training data path and a checkpoint's output path.

  Env i replays the dataset's episode i (the demos job writes one round's envs in order, failures
  kept; the tests record a single round). At step t each env gets the pipeline's sample of frame t:
  its action chunk, normalised as training sees it, padded to the model's action width, then
  turned back into env actions by ejax.train.policy.env_actions, as a trained checkpoint's are.
  """

  uses_privileged_state = False

  def __init__(self, data_config: ConfigDict, *, replan_every: int, model_action_dim: int):
    self.source = make_source(data_config)
    # The pipeline's normaliser and a checkpoint's are one (ejax.train.policy.policy_normalizer).
    self.normalizer = policy_normalizer(data_config, stats_lib.load_or_compute_stats(data_config, self.source))
    self.transform = transforms.make_sample_transform(data_config, self.normalizer, image_keys=[])
    self.replan_every, self.model_action_dim = replan_every, model_action_dim
    self.calls = 0
    episodes = self.source.meta.episodes
    self.starts, self.lengths = episodes.dataset_from, episodes.length

  def act(self, obs: dict, instructions: list[str], rng: jax.Array) -> np.ndarray:
    t = self.calls * self.replan_every
    self.calls += 1
    chunks = []
    for i in range(len(instructions)):
      episode = i
      frame = min(t, int(self.lengths[episode]) - 1)  # past the end the env is done: any action will do
      sample = self.transform(self.source[int(self.starts[episode]) + frame], np.random.default_rng(0))
      assert sample["task"] == instructions[i], "replayed episode and env disagree on the task"
      action = sample["action"]
      chunks.append(np.pad(action, ((0, 0), (0, self.model_action_dim - action.shape[-1]))))
    return env_actions(np.stack(chunks), self.normalizer, action_dim=BatchedEnv.action_size)


def replay_success(tmp_path, settings: ConfigDict, replan_every: int, horizon: int, normalization: str,
                   model_action_dim: int) -> dict:
  root = str(tmp_path / f"demos-{settings.seed}")
  summary = demos_lib.record(settings, root)
  data_config = common.data_defaults()
  data_config.update(name="lerobot", path=root, horizon=horizon, cameras=[], normalization=normalization)
  rounds = -(-settings.episodes_per_task // (settings.num_envs // len(demos_lib.resolve_tasks(settings.tasks))))
  assert rounds == 1, "the replay maps env i to episode i of one recorded round"
  policy = ReplayPolicy(data_config, replan_every=replan_every, model_action_dim=model_action_dim)
  judged = evaluate_policy(policy, eval_settings(settings, replan_every), str(tmp_path / "eval"), "replay")
  return {"expert": summary["expert_success_rate"], "replay": judged}


@pytest.mark.parametrize("replan_every, horizon, normalization, model_action_dim", [
    (8, 8, "mean_std", 4),     # GR00T runlocal: chunks of 8 executed whole, mean/std, action width 4
    (5, 10, "quantile", 32),   # pi0.5-like: quantile normalisation, 32-wide actions, replan mid-chunk
])
def test_recorded_actions_through_the_policy_output_path_reproduce_the_expert(tmp_path, replan_every, horizon,
                                                                             normalization, model_action_dim):
  settings = demo_settings("all", episodes=2, num_envs=30, seed=11)
  result = replay_success(tmp_path, settings, replan_every, horizon, normalization, model_action_dim)
  expert = np.mean(list(result["expert"].values()))
  replay = result["replay"]["overall"]["success_rate"]
  assert expert >= 0.95
  assert replay >= 0.95 and replay >= expert - 0.04, (expert, result["replay"]["table"])


def privileged_bc_success(tmp_path, tasks: list[str], *, demos_per_task: int, steps: int, batch_size: int,
                          hidden: int, judged_per_task: int) -> dict:
  """The RL job's state-based actor (configs/rl_vla3.py's policy, ejax.rl.warm_start's SFT) trained on
  the privileged-state expert's demos, judged by the eval job on layouts of another seed."""
  from configs import rl_vla3
  from ejax.rl import warm_start
  from ejax.rl.runner import make_policy
  from ejax.sim.batched import make_batched

  nnx.use_eager_sharding(False)
  config = rl_vla3.get_config("runlocal")
  config.rl.policy.hidden = hidden
  policy = make_policy(config.rl.policy, seed=0)
  demos = warm_start.collect_batched_expert_demos(
      make_batched(tasks, demos_per_task * len(tasks), backend="native"), horizon=config.rl.policy.horizon,
      action_noise=0.0, rng=jax.random.key(0))
  params = warm_start.behaviour_clone(policy, policy.initial_params, demos, steps=steps, batch_size=batch_size,
                                      learning_rate=config.rl.warm_start.learning_rate, rng=jax.random.key(1))
  cfg = ConfigDict(dict(tasks="+".join(tasks), episodes_per_task=judged_per_task, num_envs=judged_per_task * len(tasks),
                        backend="native", image_height=32, image_width=32, replan_every=config.rl.actions_per_step,
                        episode_length=0, videos_per_task=0, seed=5, checkpoint=""))
  return evaluate_policy(warm_start.EvalPolicy(policy, params), cfg, str(tmp_path / "bc_eval"), "privileged BC")


def test_privileged_state_behaviour_cloning_reaches_its_expert(tmp_path):
  """Before the fix (raw states into the MLP, 1000 steps): 22 % on this task; now ~99 %."""
  judged = privileged_bc_success(tmp_path, ["goal_lift_green_block"], demos_per_task=64, steps=3000, batch_size=64,
                                 hidden=128, judged_per_task=64)
  assert judged["overall"]["success_rate"] >= 0.8, judged["table"]


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.timeout(1800)
def test_privileged_state_behaviour_cloning_reaches_its_expert_on_every_task(tmp_path):
  """One multi-task actor on all 15 tasks (seen: 93-100 % per task, 97.8 % mean, ~3 minutes)."""
  from ejax.sim import registry
  judged = privileged_bc_success(tmp_path, registry.list_tasks(), demos_per_task=64, steps=20000, batch_size=128,
                                 hidden=256, judged_per_task=30)
  for row in judged["tasks"]:
    assert row["success_rate"] >= 0.8, judged["table"]


@pytest.mark.slow
@pytest.mark.optimised
def test_recorded_actions_reproduce_the_expert_on_every_task_at_scale(tmp_path):
  """The oracle of the CI test above over 20 recorded episodes of every task, GR00T's output path."""
  settings = demo_settings("all", episodes=20, num_envs=300, seed=12)
  result = replay_success(tmp_path, settings, replan_every=8, horizon=8, normalization="mean_std", model_action_dim=4)
  for row in result["replay"]["tasks"]:
    assert row["success_rate"] >= 0.95, result["replay"]["table"]


def overfit_groot(tmp_path, *, task: str, episodes: int, steps: int, replan_every: int, batch: int = 32) -> dict:
  """GR00T runlocal (the quickstart's model) trained on `episodes` recorded demos of one task, then
  judged by the eval job on exactly the recorded layouts (the demos' seed, tasks and env count).
  Both run as a user runs them, `python -m ejax.main` in a process of their own."""
  from tests.test_main import run_main

  def main(*args):
    result = run_main(*args, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]

  main("--config=configs/groot.py:runlocal", f"--workdir={tmp_path / 'train'}",
       f"--config.data.path={tmp_path / 'demos'}", f"--config.data.sim_demos.tasks={task}",
       f"--config.data.sim_demos.episodes_per_task={episodes}", f"--config.data.sim_demos.num_envs={episodes}",
       f"--config.train.steps={steps}", f"--config.train.global_batch_size={batch}",
       f"--config.checkpoint.every_steps={steps}", "--config.metrics.progress_bar=False", f"--config.metrics.log_every_steps={max(steps // 10, 1)}")
  # The flow-matching loss (the quickstart's total adds its keypoint heatmaps' cross-entropy, ~3 nats)
  losses = [json.loads(line).get("flow_loss", json.loads(line)["loss"]) for line in open(tmp_path / "train" / "metrics.jsonl")]
  final_loss = float(np.mean(losses[-3:]))  # one batch's loss is noisy: the last three logged
  main("--config=configs/eval.py:runlocal", f"--workdir={tmp_path}",
       f"--config.eval.checkpoint={tmp_path / 'train' / 'checkpoints'}", f"--config.eval.episodes_per_task={episodes}",
       f"--config.eval.num_envs={episodes}", f"--config.eval.replan_every={replan_every}",
       "--config.eval.videos_per_task=0", "--config.eval.seed=0", f"--config.eval.output_dir={tmp_path / 'eval'}")
  return {"final_loss": final_loss, "judged": json.load(open(tmp_path / "eval" / "summary.json"))}


@pytest.mark.slow  # CI time (2026-12-01): 440 s, the suite's longest; privileged-state BC and the recorded actions keep the loop in CI
@pytest.mark.optimised
def test_groot_overfit_on_a_handful_of_demos_succeeds_on_their_layouts(tmp_path):
  """CI-sized: batch 16 for 1500 steps (~4 min with recording and eval). Seen 2026-11-26 (after the
  shared-heatmap loss): flow loss ~1.7 -> 0.07-0.10 and 4 of 4 layouts solved with seeds 0, 1, 2 at
  1200 steps; 800 steps (0.17, the grasp slid off the block on one layout) and 1000 (0.14) solved 3 of 4.
  Since 2026-11-27 the initial weights are drawn on the host (ejax.train.host_init: the same
  distributions, other draws): at 1200 steps seeds 1 and 2 solved 4 of 4 (0.066, 0.058) and seed 0
  3 of 4 (0.095, twice); at 1500 steps seed 0 solved 4 of 4 (0.088)."""
  result = overfit_groot(tmp_path, task="goal_lift_green_block", episodes=4, steps=1500, replan_every=4, batch=16)
  judged = result["judged"]
  assert judged["tasks"][0]["task"] == "goal_lift_green_block" and judged["overall"]["episodes"] == 4
  assert result["final_loss"] < 0.15
  assert judged["overall"]["success_rate"] >= 0.9, judged


@pytest.mark.slow
@pytest.mark.optimised
@pytest.mark.timeout(1800)
def test_groot_overfit_on_a_handful_of_demos_of_each_kind_of_task(tmp_path):
  """The same on a pick-and-place task, longer: 8 demos, 1500 steps, as the lift's test since the
  host-drawn initial weights (2026-12-03: 1200 steps solved 7 of 8, flow loss 0.11; 1500 solved 8 of 8)."""
  result = overfit_groot(tmp_path, task="goal_red_block_to_plate", episodes=8, steps=1500, replan_every=4)
  assert result["final_loss"] < 0.15
  assert result["judged"]["overall"]["success_rate"] >= 0.9, result["judged"]
