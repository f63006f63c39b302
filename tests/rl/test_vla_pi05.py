"""pi0.5 as the RL actor (ejax.rl.vla_pi05): the RL policy is the SFT policy, the prefix runs once per
sample, the learner scores with the cached context alone, and RL versions load in the serve job.

The SFT checkpoint: configs/pi05.py:runlocal,dataset=sim (with the perception module, so the cached
context holds its state slots too) on 2 recorded demos of one ejax.sim task, trained 2 steps.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl_vla3
from ejax.models import pi05 as pi05_lib
from ejax.models import pi05_inputs
from ejax.rl import runner
from ejax.sim import registry
from tests.train.helpers import load_config

TASK, IMAGE_SIZE, ACTION_DIM, HORIZON = "goal_lift_green_block", 64, 4, 10


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
  from ejax.train.loop import train
  root = tmp_path_factory.mktemp("pi05_sft")
  config = load_config("configs/pi05.py", "runlocal,dataset=sim,steps=2,batch=8")
  config.data.path = str(root / "demos")
  config.data.sim_demos.update(tasks=TASK, episodes_per_task=2, num_envs=2)
  config.metrics.update(tensorboard=False, progress_bar=False)
  config.checkpoint.update(async_save=False, every_steps=2)
  config.compilation_cache_dir = ""  # keep the tests' own compilation cache (tests/conftest.py)
  train(config, str(root / "sft"))
  return str(root / "sft" / "checkpoints")


def rl_config(sft_checkpoint: str, arg: str = ""):
  return rl_vla3.get_config(f"runlocal,actor=pi05,sft={sft_checkpoint}{arg}")


@pytest.fixture(scope="module")
def policy(sft_checkpoint):
  return runner.make_policy(rl_config(sft_checkpoint).rl.policy, seed=0)


@pytest.fixture(scope="module")
def sft_policy(sft_checkpoint):
  from ejax.train.policy import load_policy
  return load_policy(sft_checkpoint)


def observations(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Env-like observations of several tasks (the global task index picks the instruction)."""
  rng = np.random.default_rng(seed)
  tasks = registry.list_tasks()
  obs = {"observation.state": rng.normal(0.0, 0.3, (n, 11)).astype(np.float32),
         "observation.environment_state": rng.normal(0.0, 0.3, (n, 7)).astype(np.float32),
         "task_index": np.asarray([tasks.index(TASK)] + list(rng.integers(0, len(tasks), n - 1)), np.int32)}
  for camera in ("agentview", "wrist"):
    obs[f"observation.images.{camera}"] = rng.integers(0, 256, (n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
  # where the target and its goal appear in each camera (the perception module's labels), one out of view
  obs["observation.environment_pixels"] = rng.uniform(-1.0, 1.0, (n, 8)).astype(np.float32)
  obs["observation.environment_pixels"][0, 4:6] = 10.0
  return obs


def instructions(obs) -> list[str]:
  return [registry.get_spec(registry.list_tasks()[i]).instruction for i in obs["task_index"]]


@pytest.mark.slow  # CI time: the GR00T actor's twin test runs in CI
def test_in_jit_batch_is_what_the_train_collate_makes(policy, sft_policy):
  """Prompt tokens (task text and state bins), images and the state vector of every sample equal
  the checkpoint collate's for the same observations."""
  obs = observations(5)
  batch = jax.device_get(jax.jit(lambda o: policy.actor_inputs(o)[0])(policy.select_observations(obs)))
  train = sft_policy.collate(sft_policy._samples(obs, instructions(obs)))
  config = sft_policy.config.model
  patches = pi05_inputs.patches_per_image(config)
  train_rows, ours_index = pi05_inputs.sample_rows(train), pi05_inputs.image_token_indices(batch, patches)
  train_index = pi05_inputs.image_token_indices(train, patches)
  assert batch["images"].shape == (5 * 2, IMAGE_SIZE, IMAGE_SIZE, 3) and batch["prefix_tokens"].shape[0] == 5
  for i in range(5):
    row = train_rows[i]
    theirs = train["prefix_segment_ids"][row] == train["sample_slot"][i] + 1
    ours = batch["prefix_segment_ids"][i] == 1
    np.testing.assert_array_equal(batch["prefix_tokens"][i][ours], train["prefix_tokens"][row][theirs])
    np.testing.assert_array_equal(batch["prefix_positions"][i][ours], train["prefix_positions"][row][theirs])
    np.testing.assert_array_equal(batch["prefix_is_image"][i][ours], train["prefix_is_image"][row][theirs])
    is_image = batch["prefix_is_image"][i][ours]
    assert is_image.sum() == 2 * patches and not batch["prefix_tokens"][i][~ours].any()
    ours_images = batch["images"][ours_index[i][ours][is_image] // patches]
    theirs_images = train["images"][train_index[row][theirs][is_image] // patches]
    np.testing.assert_array_equal(ours_images, theirs_images)  # 64 px renders: no resize on either side
  np.testing.assert_allclose(batch["state"], train["state"], rtol=1e-6, atol=1e-6)


def test_prefix_runs_once_and_cached_log_probs_agree(policy, monkeypatch):
  obs = policy.select_observations(observations(4, seed=1))
  calls = {"prefix": 0, "expert": 0}
  given_weights = []

  def counting(name, method):
    def wrapped(self, *args, **kwargs):
      if name == "expert":  # the expert's compute-dtype weights come made, once a call (flow_constants)
        given_weights.append(kwargs.get("expert_weights") is not None)
      out = method(self, *args, **kwargs)
      leaf = jax.tree.leaves(out)[0]
      # Counts executions, not traces: the expert runs inside the sampler's loop.
      jax.debug.callback(lambda x: calls.__setitem__(name, calls[name] + 1), jnp.sum(leaf))
      return out
    return wrapped

  monkeypatch.setattr(pi05_lib.Pi05, "prefix_cache", counting("prefix", pi05_lib.Pi05.prefix_cache))
  monkeypatch.setattr(pi05_lib.Pi05, "expert_velocity", counting("expert", pi05_lib.Pi05.expert_velocity))
  sample = jax.jit(policy.sample)(policy.initial_params, obs, jax.random.key(0))
  jax.block_until_ready(sample)
  steps = policy.num_steps
  assert calls == {"prefix": 1, "expert": steps} and steps == 10
  assert given_weights and all(given_weights)
  assert sample["chain"].shape == (4, steps + 1, HORIZON, ACTION_DIM) and sample["actions"].shape == (4, HORIZON, 4)
  context = sample["context"]
  assert context["k"].shape[:2] == (4, 2) and context["perception_state"].shape == (4, 26)
  # The learner's scoring: the cached context, the action expert once, no prefix.
  log_prob, value = jax.jit(policy.evaluate)(policy.initial_params, obs, sample["chain"], sample["step_index"],
                                             context)
  jax.block_until_ready(log_prob)
  assert calls == {"prefix": 1, "expert": steps + 1}
  np.testing.assert_allclose(log_prob, sample["log_prob"], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(value, sample["value"], rtol=1e-6)
  # Without the context the prefix runs again and scores the same.
  uncached, _ = jax.jit(policy.evaluate)(policy.initial_params, obs, sample["chain"], sample["step_index"])
  np.testing.assert_allclose(uncached, sample["log_prob"], rtol=1e-5, atol=1e-4)
  assert calls["prefix"] == 2
  # Moving the sampled step's result moves the log-prob: the Gaussian step is really scored.
  moved = np.asarray(sample["chain"]).copy()
  moved[np.arange(4), sample["step_index"] + 1, :, 0] += 1.0
  lower, _ = jax.jit(policy.evaluate)(policy.initial_params, obs, moved, sample["step_index"], context)
  assert np.all(np.asarray(lower) < np.asarray(sample["log_prob"]) - 1.0)


@pytest.mark.slow  # CI time: the GR00T actor's twin test runs in CI
def test_deterministic_actions_are_the_sft_policy(policy, sft_policy):
  from ejax.rl.warm_start import EvalPolicy
  obs = observations(6, seed=2)
  ours = EvalPolicy(policy, policy.initial_params).act(obs, None, jax.random.key(7))
  theirs = sft_policy.act(obs, instructions(obs), jax.random.key(7))
  assert ours.shape == theirs.shape == (6, HORIZON, ACTION_DIM)
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
  assert np.abs(theirs).max() > 0.05  # not a trivially zero policy


def rollout_batch(policy, params, steps: int = 2, envs: int = 4) -> dict:
  """A learner batch of `steps` sampled segments [T, N, ...] with a made-up reward."""
  samples, observations_ = [], []
  for t in range(steps):
    obs = policy.select_observations(observations(envs, seed=10 + t))
    samples.append(jax.jit(policy.sample)(params, obs, jax.random.key(t)))
    observations_.append(obs)
  stack = lambda trees: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
  sampled = stack(samples)
  reward = np.asarray(sampled["actions"][..., 0].mean(axis=-1), np.float32)  # prefers larger first action dims
  return {"observation": stack(observations_), "chain": sampled["chain"], "step_index": sampled["step_index"],
          "log_prob": sampled["log_prob"], "context": sampled["context"], "reward": reward,
          "done": np.zeros((steps, envs), bool), "valid": np.ones((steps, envs), bool),
          "success": np.zeros((steps, envs), bool),
          "bootstrap_observation": policy.select_observations(observations(envs, seed=99))}


@pytest.mark.slow  # CI time: the GR00T actor's twin test runs in CI
def test_learner_steps_move_the_action_expert_only(sft_checkpoint):
  """With rl.policy.perception_loss=0 the cached context is all upstream of the expert: only the
  action expert (and the critic) move."""
  from ejax.rl.learner import make_update_fn
  from ejax.rl.pipeline import make_optimizer
  from ejax.rl.vla_pi05 import FLOW_PARTS
  config = rl_config(sft_checkpoint).rl
  config.policy.perception_loss = 0.0
  policy = runner.make_policy(config.policy, seed=0)
  assert policy.auxiliary_inputs is None
  optimizer = make_optimizer(config, policy.trainable_mask)
  update = jax.jit(make_update_fn(policy, optimizer, algorithm="ppo", gamma=config.gamma, gae_lambda=config.gae_lambda,
                                  clip_epsilon=config.clip_epsilon, behaviour_weight_threshold=None, dual_clip=None,
                                  value_coef=config.value_coef, num_epochs=2, num_minibatches=2, group_size=1))
  params, opt_state = policy.initial_params, optimizer.init(policy.initial_params)
  for step in range(2):
    params, opt_state, metrics = update(params, opt_state, rollout_batch(policy, params), jax.random.key(step))
    assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics))
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), params, policy.initial_params)
  flat = [(jax.tree_util.keystr(path), m) for path, m in jax.tree_util.tree_flatten_with_path(moved)[0]]
  moved_paths = [path for path, m in flat if m]
  assert any("'expert'" in path for path in moved_paths) and any("'critic'" in path for path in moved_paths)
  upstream = [p for p in moved_paths if "'critic'" not in p and not any(f"'{part}'" in p for part in FLOW_PARTS)]
  assert upstream == []  # the LLM, the vision tower and the perception module stay as SFT left them


def test_perception_loss_trains_the_perception_module_on_the_simulator_labels(sft_checkpoint, sft_policy):
  """rl.policy.perception_loss: the learner adds the perception module's own losses (the train step's,
  on the rollouts' frames against the simulator's labels, normalised as SFT's targets were), so the
  module moves with the action expert; the LLM and the vision tower still do not."""
  from ejax.rl.learner import make_update_fn
  from ejax.rl.pipeline import make_optimizer
  from ejax.rl.vla_pi05 import FLOW_PARTS
  from ejax.train.policy import policy_normalizer
  config = rl_config(sft_checkpoint).rl
  config.policy.perception_loss = 2.0
  policy = runner.make_policy(config.policy, seed=0)
  obs = policy.select_observations(observations(4, seed=3))
  assert {"observation.environment_state", "observation.environment_pixels"} <= set(obs)
  labelled = jax.jit(policy.auxiliary_inputs)(obs)[0]
  key = sft_policy.data.aux_state_key
  expected = policy_normalizer(sft_policy.data, sft_policy.norm_stats, [key]).normalize(key, obs[key])
  assert np.abs(expected - obs[key]).max() > 1e-3  # the statistics do something
  np.testing.assert_allclose(labelled["aux_state"], expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(labelled["aux_pixels"], obs["observation.environment_pixels"])
  np.testing.assert_array_equal(labelled["aux_mask"], np.ones(4))
  loss, metrics = jax.jit(policy.auxiliary_loss)(policy.initial_params, obs)
  assert set(metrics) == {"aux_state_loss", "aux_heatmap_loss"}
  perception = sft_policy.config.model.perception
  weighted = perception.estimate.weight * metrics["aux_state_loss"] + perception.detectors.weight * metrics["aux_heatmap_loss"]
  np.testing.assert_allclose(loss, 2.0 * weighted, rtol=1e-5)
  assert float(metrics["aux_state_loss"]) > 0 and float(metrics["aux_heatmap_loss"]) > 0

  optimizer = make_optimizer(config, policy.trainable_mask)
  update = jax.jit(make_update_fn(policy, optimizer, algorithm="ppo", gamma=config.gamma, gae_lambda=config.gae_lambda,
                                  clip_epsilon=config.clip_epsilon, behaviour_weight_threshold=None, dual_clip=None,
                                  value_coef=config.value_coef, num_epochs=1, num_minibatches=1, group_size=1))
  params, opt_state = policy.initial_params, optimizer.init(policy.initial_params)
  params, _, metrics = update(params, opt_state, rollout_batch(policy, params, steps=1), jax.random.key(0))
  assert all(np.isfinite(float(v)) for v in jax.tree.leaves(metrics)) and "aux_heatmap_loss" in metrics
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), params, policy.initial_params)
  moved_paths = [jax.tree_util.keystr(path) for path, m in jax.tree_util.tree_flatten_with_path(moved)[0] if m]
  assert any("'perception'" in path for path in moved_paths) and any("'expert'" in path for path in moved_paths)
  trained = FLOW_PARTS + ("perception", "critic")
  assert [p for p in moved_paths if not any(f"'{part}'" in p for part in trained)] == []  # LLM and vision tower


def test_rl_versions_load_in_the_serve_job(policy, sft_checkpoint, tmp_path):
  """An RL version of a pi0.5 actor, saved as the rl job saves it, is served as the pi0.5 policy it is
  (the SFT checkpoint's observations, prompt and normalisation) and acts as the RL policy does."""
  from ml_collections import ConfigDict

  from ejax.rl.checkpoint import RLCheckpointer
  from ejax.rl.warm_start import EvalPolicy
  from ejax.serve.load import load_served_policy
  params = jax.tree.map(np.array, policy.initial_params)  # writable copies
  expert = params["actor"]["pi05"]["action_out_proj"]["kernel"]
  expert[...] = expert[...] * 1.5  # version 1: a moved action expert
  policy_config = rl_config(sft_checkpoint).rl.policy
  checkpointer = RLCheckpointer(str(tmp_path / "rl_checkpoints"))
  checkpointer.save(1, params, {}, metadata={"policy": policy_config.to_dict()})
  checkpointer.close()
  served, source = load_served_policy(ConfigDict(dict(serve=dict(checkpoint=str(tmp_path / "rl_checkpoints"),
                                                                 version=-1, weights="same"))), str(tmp_path))
  assert source.version == 1
  obs = observations(3, seed=4)
  expected = EvalPolicy(policy, params).act(obs, None, jax.random.key(3))
  np.testing.assert_allclose(served.act(obs, instructions(obs), jax.random.key(3)), expected, rtol=1e-4, atol=1e-4)
  unchanged = EvalPolicy(policy, policy.initial_params).act(obs, None, jax.random.key(3))
  assert np.abs(np.asarray(expected) - np.asarray(unchanged)).max() > 1e-3  # version 1 really differs


def test_config_errors_name_the_fix():
  from ejax.config.validate import ConfigError
  with pytest.raises(ConfigError, match=r"actor=pi05 needs sft=<a pi0.5 train job's checkpoints dir>"):
    rl_vla3.get_config("runlocal,actor=pi05")
  config = rl_vla3.get_config("runlocal,actor=pi05,sft=/x")
  assert config.rl.policy.kind == "pi05" and config.rl.policy.cache_context and config.rl.warm_start.steps == 0
  assert config.rl.policy.perception_loss == 1.0 and config.rl.perception_learning_rate == 3e-4


@pytest.mark.slow  # ~22 minutes on 2 idle cores (SFT ~3, RL and judging ~18); opt-in (-m slow)
@pytest.mark.optimised
@pytest.mark.timeout(5400)
def test_runlocal_rl_lifts_a_weak_pi05_start_by_twenty_points(tmp_path):
  """Issue 33's bar for the pi0.5 actor, as configs/rl_vla3.py's docstring runs it: a weak SFT start
  (configs/pi05.py:runlocal,dataset=sim stopped at step 1000 of 2500; seen 0.33 -> 0.64 on 2026-11-27), then RL-VLA3 with
  `configs/rl_vla3.py:runlocal,actor=pi05` (<= 30 minutes on 2 cores): >= 20 points more on "lift the
  green block", Wilson intervals disjoint (400 judged episodes each). Failed on 2026-12-03, when the
  start had grown stronger (0.475 -> 0.598, +12) with the perception module frozen; passes with it
  trained beside the actor (rl.policy.perception_loss): 0.475 -> 0.820 on 2026-12-04 (BENCHMARKS.md)."""
  from tests.rl.test_runner import assert_intervals_disjoint
  from tests.test_main import run_main

  def main(*args, timeout):
    result = run_main(*args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]

  main("--config=configs/pi05.py:runlocal,dataset=sim", "--config.train.stop_at=1000",
       "--config.metrics.progress_bar=False", f"--workdir={tmp_path / 'sft'}", timeout=1800)
  start = time.perf_counter()
  rl_arg = f"runlocal,actor=pi05,sft={tmp_path / 'sft' / 'checkpoints'}"
  main(f"--config=configs/rl_vla3.py:{rl_arg}", f"--workdir={tmp_path / 'rl'}", timeout=2700)
  minutes = (time.perf_counter() - start) / 60
  summary = json.load(open(tmp_path / "rl" / "rl_summary.json"))
  assert summary["lag_max"] <= summary["eta"] and summary["threads_alive"] == []
  assert summary["success_after"] - summary["success_before"] >= 0.2, summary
  assert_intervals_disjoint(summary, rl_vla3.get_config(rl_arg).rl.judge.episodes)
  print(f"pi0.5 RL: {summary['success_before']:.2f} -> {summary['success_after']:.2f} in {minutes:.1f} minutes")
  assert os.path.isdir(tmp_path / "rl" / "rl_checkpoints")
