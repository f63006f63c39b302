"""GR00T as the RL actor (ejax.rl.vla): the RL policy is the SFT policy, seen and scored consistently.

The SFT checkpoint is the session's shared small one (tests/conftest.py: groot_sft_checkpoint):
32 px demos of one ejax.sim task, configs/groot.py:runlocal trained 2 steps, max_action_dim 6 so
the chain has padded action dims (the env's actions are 4-d).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl_vla3
from ejax.models import groot as groot_lib
from ejax.models import groot_inputs
from ejax.rl import runner
from ejax.sim import registry
from tests.train.helpers import SFT_IMAGE_SIZE, SFT_MAX_ACTION_DIM, SFT_TASK

TASK, IMAGE_SIZE, MAX_ACTION_DIM = SFT_TASK, SFT_IMAGE_SIZE, SFT_MAX_ACTION_DIM
ACTION_DIM = 4


@pytest.fixture(scope="module")
def sft_checkpoint(groot_sft_checkpoint):
  return groot_sft_checkpoint


def rl_config(sft_checkpoint: str, arg: str = ""):
  return rl_vla3.get_config(f"runlocal,actor=groot,sft={sft_checkpoint},size={IMAGE_SIZE}{arg}")


@pytest.fixture(scope="module")
def policy(sft_checkpoint):
  return runner.make_policy(rl_config(sft_checkpoint).rl.policy, seed=0)


@pytest.fixture(scope="module")
def sft_policy(sft_checkpoint):
  from ejax.train.policy import load_policy
  return load_policy(sft_checkpoint)


def observations(n: int, image_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Env-like observations of several tasks (the global task index picks the instruction)."""
  rng = np.random.default_rng(seed)
  tasks = registry.list_tasks()
  obs = {"observation.state": rng.normal(0.0, 0.3, (n, 11)).astype(np.float32),
         "observation.environment_state": rng.normal(0.0, 0.3, (n, 7)).astype(np.float32),
         "task_index": np.asarray([tasks.index(TASK)] + list(rng.integers(0, len(tasks), n - 1)), np.int32)}
  for camera in ("agentview", "wrist"):
    obs[f"observation.images.{camera}"] = rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8)
    obs[f"observation.depth.{camera}"] = rng.uniform(0, 2, (n, image_size, image_size)).astype(np.float32)
  return obs


def instructions(obs) -> list[str]:
  return [registry.get_spec(registry.list_tasks()[i]).instruction for i in obs["task_index"]]


def test_in_jit_batch_is_what_the_train_collate_makes(policy, sft_policy):
  """Tokens, positions, image placement, images and normalised state of every sample equal the
  train collate's for the same observations (images rendered at 64 px, resized in jit like PIL)."""
  obs = observations(5, 2 * IMAGE_SIZE)
  selected = policy.select_observations(obs)
  assert sorted(selected) == ["observation.environment_state", "observation.images.agentview",
                              "observation.images.wrist", "observation.state", "task_index"]  # no depth
  batch = jax.device_get(jax.jit(lambda o: policy.actor_inputs(o)[0])(selected))
  # CheckpointPolicy's host path: normalise, resize (PIL), the model's own collate (packed rows).
  train = sft_policy.collate(sft_policy._samples(obs, instructions(obs)))
  config = sft_policy.config.model
  per_image = groot_inputs.tokens_per_image(config)
  train_rows = groot_inputs.sample_rows(train)
  train_image_index = groot_inputs.image_token_indices(train, per_image)
  ours_image_index = groot_inputs.image_token_indices(batch, per_image)
  assert batch["images"].shape == train["images"].shape == (5 * 2, IMAGE_SIZE, IMAGE_SIZE, 3)
  for i in range(5):
    row = train_rows[i]
    theirs = train["vl_segment_ids"][row] == train["sample_segment"][i]
    ours = batch["vl_segment_ids"][i] == 1
    np.testing.assert_array_equal(batch["vl_tokens"][i][ours], train["vl_tokens"][row][theirs])
    np.testing.assert_array_equal(batch["vl_positions"][i][ours], train["vl_positions"][row][theirs])
    assert not batch["vl_tokens"][i][~ours].any()  # the rest of the row is padding
    is_image = batch["vl_tokens"][i][ours] == config.image_token_id
    assert is_image.sum() == 2 * per_image
    ours_index = ours_image_index[i][ours][is_image]
    theirs_index = train_image_index[row][theirs][is_image]
    np.testing.assert_array_equal(ours_index % per_image, theirs_index % per_image)  # same patch order
    ours_images = batch["images"][ours_index // per_image].astype(int)
    theirs_images = train["images"][theirs_index // per_image].astype(int)
    assert np.abs(ours_images - theirs_images).max() <= 1  # jax vs PIL antialiased bilinear: rounding only
  np.testing.assert_allclose(batch["state"], train["state"], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(batch["embodiment_id"], train["embodiment_id"])
  assert batch["state"].shape[1] == config.max_state_dim and not batch["state"][:, 11:].any()


def test_log_probs_agree_and_the_backbone_runs_once_per_call(policy, monkeypatch):
  obs = policy.select_observations(observations(4, IMAGE_SIZE, seed=1))
  calls = {"backbone": 0, "dit": 0}

  def counting(name, method):
    def wrapped(self, *args, **kwargs):
      out = method(self, *args, **kwargs)
      # Counts executions, not traces: the DiT runs inside the sampler's loop.
      jax.debug.callback(lambda x: calls.__setitem__(name, calls[name] + 1), jnp.sum(out))
      return out
    return wrapped

  monkeypatch.setattr(groot_lib.GrootBackbone, "__call__", counting("backbone", groot_lib.GrootBackbone.__call__))
  monkeypatch.setattr(groot_lib.GrootActionHead, "velocity", counting("dit", groot_lib.GrootActionHead.velocity))
  sample = jax.jit(policy.sample)(policy.initial_params, obs, jax.random.key(0))
  jax.block_until_ready(sample)
  assert calls == {"backbone": 1, "dit": policy.num_steps} and policy.num_steps == 4
  evaluate = jax.jit(policy.evaluate)
  log_prob, value = evaluate(policy.initial_params, obs, sample["chain"], sample["step_index"])
  jax.block_until_ready(log_prob)
  assert calls == {"backbone": 2, "dit": policy.num_steps + 1}
  np.testing.assert_allclose(log_prob, sample["log_prob"], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(value, sample["value"], rtol=1e-6)
  assert sample["chain"].shape == (4, 5, 8, MAX_ACTION_DIM) and sample["actions"].shape == (4, 8, ACTION_DIM)

  # The chain's padded action dims do not count in the log-prob; a real dim does.
  rows = np.arange(4)
  after = np.asarray(sample["chain"]).copy()
  after[rows, sample["step_index"] + 1, :, ACTION_DIM:] += 1.0
  padded, _ = evaluate(policy.initial_params, obs, after, sample["step_index"])
  np.testing.assert_allclose(padded, sample["log_prob"], rtol=1e-5, atol=1e-4)
  after[rows, sample["step_index"] + 1, :, 0] += 1.0
  real, _ = evaluate(policy.initial_params, obs, after, sample["step_index"])
  assert np.all(np.asarray(real) < np.asarray(sample["log_prob"]) - 1.0)

  # The env's actions are the chain's end, cut to the env's dims and unnormalised (mean_std).
  center, scale = policy_action_stats(policy)
  np.testing.assert_allclose(sample["actions"], np.asarray(sample["chain"])[:, -1, :, :ACTION_DIM] * scale + center,
                             rtol=1e-5, atol=1e-5)


def test_cached_context_scores_the_same_without_the_backbone(sft_checkpoint, policy, monkeypatch):
  from ejax.rl.vla import FLOW_PARTS
  config = rl_config(sft_checkpoint).rl.policy
  config.cache_context = True
  cached = runner.make_policy(config, seed=0)
  obs = cached.select_observations(observations(4, IMAGE_SIZE, seed=1))
  sample = jax.jit(cached.sample)(cached.initial_params, obs, jax.random.key(0))
  reference = jax.jit(policy.sample)(policy.initial_params, obs, jax.random.key(0))
  np.testing.assert_allclose(sample["actions"], reference["actions"], rtol=1e-5, atol=1e-5)
  calls = {"backbone": 0}

  def counting(self, *args, **kwargs):
    out = backbone_call(self, *args, **kwargs)
    jax.debug.callback(lambda x: calls.__setitem__("backbone", calls["backbone"] + 1), jnp.sum(out))
    return out

  backbone_call = groot_lib.GrootBackbone.__call__
  monkeypatch.setattr(groot_lib.GrootBackbone, "__call__", counting)
  log_prob, value = jax.jit(cached.evaluate)(cached.initial_params, obs, sample["chain"], sample["step_index"],
                                             sample["context"])
  jax.block_until_ready(log_prob)
  assert calls["backbone"] == 0  # the learner's log-probs run the flow alone
  np.testing.assert_allclose(log_prob, sample["log_prob"], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(value, sample["value"], rtol=1e-6)
  # Only the flow part (and the critic) may train: everything upstream of the cached context is frozen.
  flat = jax.tree_util.tree_flatten_with_path(cached.trainable_mask)[0]
  trained = [jax.tree_util.keystr(path) for path, trainable in flat if trainable]
  assert trained and all(any(part in path for part in FLOW_PARTS + ("critic",)) for path in trained)
  assert any("dit" in path for path in trained) and not any("llm" in path or "vision" in path for path in trained)


def policy_action_stats(policy):
  env_actions = policy.env_actions
  zero = env_actions(jnp.zeros((1, 1, MAX_ACTION_DIM)))[0, 0]
  one = env_actions(jnp.ones((1, 1, MAX_ACTION_DIM)))[0, 0]
  return np.asarray(zero), np.asarray(one - zero)


def test_deterministic_actions_are_the_sft_policy(policy, sft_policy):
  from ejax.rl.warm_start import EvalPolicy
  obs = observations(6, IMAGE_SIZE, seed=2)
  # EvalPolicy: the RL job's and the eval job's way of running it (deterministic Euler, env actions).
  ours = EvalPolicy(policy, policy.initial_params).act(obs, None, jax.random.key(7))
  theirs = sft_policy.act(obs, instructions(obs), jax.random.key(7))
  assert ours.shape == theirs.shape == (6, 8, ACTION_DIM)
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
  assert np.abs(theirs).max() > 0.05  # not a trivially zero policy


@pytest.mark.slow  # ~2.5 minutes; opt-in (-m slow) to keep CI under 25 minutes
@pytest.mark.optimised
@pytest.mark.timeout(900)
def test_rl_job_fine_tunes_the_sft_checkpoint_and_the_eval_job_rebuilds_it(sft_checkpoint, policy, tmp_path):
  from configs import eval as eval_config
  from ejax.eval import evaluate
  from ejax.rl.checkpoint import RLCheckpointer
  from ejax.rl.warm_start import EvalPolicy
  config = rl_config(sft_checkpoint, ",updates=2")
  config.rl.update(num_shards=2, envs_per_shard=2, segment_length=2, segments_per_update=2, num_minibatches=2,
                   queue_size=4, critic_warmup_updates=0, checkpoint_every_updates=1, learning_rate=1e-3)
  config.rl.judge.update(episodes=2, videos=0, episode_length=8)
  workdir = str(tmp_path / "rl")
  summary = runner.run_job(config, workdir)
  assert summary["version"] == 2 and summary["lag_max"] <= summary["eta"] == 2
  assert summary["threads_alive"] == [] and summary["env_steps"] > 0

  checkpoints = RLCheckpointer(os.path.join(workdir, "rl_checkpoints"))
  assert checkpoints.all_versions() == [0, 1, 2]
  start, _ = checkpoints.restore_params(policy.initial_params, 0)
  end, metadata = checkpoints.restore_params(policy.initial_params, 2)
  checkpoints.close()
  assert metadata["policy"]["kind"] == "groot" and metadata["policy"]["checkpoint"] == os.path.abspath(sft_checkpoint)
  # Version 0 is the SFT checkpoint; the learner moved trainable parameters only.
  for saved, initial in zip(jax.tree.leaves(start["actor"]), jax.tree.leaves(policy.initial_params["actor"])):
    np.testing.assert_array_equal(saved, initial)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), start, end)
  flat_moved = jax.tree_util.tree_flatten_with_path(moved)[0]
  flat_mask = jax.tree.leaves(policy.trainable_mask)
  frozen_moved = [jax.tree_util.keystr(path) for (path, m), t in zip(flat_moved, flat_mask) if m and not t]
  assert frozen_moved == []
  assert any(m for (path, m), t in zip(flat_moved, flat_mask) if t and "'actor'" in jax.tree_util.keystr(path))
  assert any("llm" in jax.tree_util.keystr(path) for (path, _), t in zip(flat_moved, flat_mask) if not t)

  # The eval job's policy=rl rebuilds version 2 from the RL checkpoint alone (plus the SFT dir it names).
  eval_cfg = eval_config.get_config("policy=rl")
  eval_cfg.eval.update(checkpoint=os.path.join(workdir, "rl_checkpoints"), version=-1)
  rebuilt = evaluate.make_policy(eval_cfg, ACTION_DIM)
  for a, b in zip(jax.tree.leaves(rebuilt.params), jax.tree.leaves(end)):
    np.testing.assert_array_equal(a, b)
  obs = observations(6, IMAGE_SIZE, seed=3)  # the batch test 3 compiled for
  expected = EvalPolicy(policy, end).act(obs, None, jax.random.key(1))
  np.testing.assert_allclose(rebuilt.act(obs, instructions(obs), jax.random.key(1)), expected, rtol=1e-5, atol=1e-5)


def test_config_and_missing_checkpoint_errors_name_the_fix(tmp_path):
  from ejax.checkpoint import CheckpointError
  from ejax.config.validate import ConfigError
  with pytest.raises(ConfigError, match="sft=<a GR00T train job's checkpoints dir>"):
    rl_vla3.get_config("runlocal,actor=groot")
  config = rl_config(str(tmp_path / "gone"))
  assert config.rl.warm_start.steps == 0 and config.rl.env.kwargs.cameras
  with pytest.raises(CheckpointError, match="starts from, and is rebuilt from, its SFT checkpoint"):
    runner.make_policy(config.rl.policy, seed=0)


def test_perception_loss_on_an_actor_without_it_names_the_fix(sft_checkpoint):
  """rl.policy.perception_loss > 0 asks the actor to train its perception module on the simulator's
  labels: the GR00T actor has no such loss, so it is one line naming the setting, not a silent no-op."""
  config = rl_config(sft_checkpoint)
  config.rl.policy.perception_loss = 1.0
  with pytest.raises(ValueError, match=r"GR00T's RL actor has no such loss\); set rl.policy.perception_loss=0"):
    runner.make_policy(config.rl.policy, seed=0)
