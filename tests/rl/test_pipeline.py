"""The three-level pipeline end to end on CPU: staleness, barriers, metrics, checkpoints, faults.

One small flow policy and one env are shared by every test so the sampler, the chunk step and the
learner update compile once for the whole module.
"""


import jax
import numpy as np
import pytest
from flax import nnx

from configs.common import SHARDING_RULES
from ejax.rl.checkpoint import RLCheckpointer
from ejax.rl import multihost
from ejax.rl.coordination import SegmentTickets
from ejax.rl.pipeline import RLPipeline, RLRunError, default_config
from ejax.rl.point_env import PointReach
from ejax.rl.policy import mlp_flow_policy

pytestmark = pytest.mark.timeout(300)

NUM_SHARDS, ENVS, STEPS, ACTIONS_PER_STEP, SEGMENTS_PER_UPDATE = 3, 4, 3, 2, 3


@pytest.fixture(scope="module")
def policy():
  return mlp_flow_policy(state_dim=4, action_dim=2, horizon=2, num_tasks=4, num_steps=2, hidden=16, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def env():
  return PointReach(num_tasks=4, state_dim=4, action_dim=2, max_steps=6)


def make_config(**overrides):
  config = default_config()
  config.update(num_shards=NUM_SHARDS, envs_per_shard=ENVS, segment_length=STEPS, actions_per_step=ACTIONS_PER_STEP,
                segments_per_update=SEGMENTS_PER_UPDATE, num_updates=4, num_minibatches=3, num_epochs=1, eta=1,
                inference_full_batch_only=True, queue_size=4)
  config.delay.update(kind="exponential", mean=0.002)
  config.update(overrides)
  return config


def assert_all_joined(pipeline):
  assert not [thread.name for thread in pipeline.threads if thread.is_alive()]


def test_async_run_bounds_lag_and_reports_metrics(policy, env, tmp_path):
  pipeline = RLPipeline(make_config(num_updates=4, eta=1), env, policy, checkpoint_dir=str(tmp_path / "ckpt"))
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["version"] == 4 and summary["stop_reason"] is None
  assert 0 <= summary["lag_max"] <= 1
  assert summary["env_steps"] == 4 * SEGMENTS_PER_UPDATE * STEPS * ENVS * ACTIONS_PER_STEP
  assert summary["env_steps_per_s"] > 0 and summary["learner_updates_per_s"] > 0
  assert set(summary["busy_fraction"]) == {"env0", "env1", "env2", "inference", "learner"}
  assert all(0 < fraction <= 1.0 for fraction in summary["busy_fraction"].values())
  for key in ("wait/learner_queue_get/mean_s", "wait/env_inference/mean_s", "approx_kl_behaviour", "clip_fraction"):
    assert np.isfinite(summary[key])
  assert len(summary["success_vs_time"]) == 4
  # Parameters moved and each update published a new version.
  assert pipeline.param_store.version == 4
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(policy.initial_params),
                                                   jax.tree.leaves(pipeline.learner.params)))
  pipeline.plot(str(tmp_path / "timeline.png"))
  assert (tmp_path / "timeline.png").stat().st_size > 1000

  # Resume: a new pipeline on the same directory continues from version 4 to 6.
  assert RLCheckpointer(str(tmp_path / "ckpt")).latest_version() == 4
  resumed = RLPipeline(make_config(num_updates=6, eta=1), env, policy, checkpoint_dir=str(tmp_path / "ckpt"))
  assert resumed.start_version == 4
  for restored, saved in zip(jax.tree.leaves(resumed.learner.params), jax.tree.leaves(pipeline.learner.params)):
    np.testing.assert_array_equal(restored, saved)
  summary = resumed.run()
  assert_all_joined(resumed)
  assert summary["version"] == 6
  assert summary["env_steps"] == 2 * SEGMENTS_PER_UPDATE * STEPS * ENVS * ACTIONS_PER_STEP


def test_sync_mode_steps_all_shards_in_lockstep_with_zero_lag(policy, env):
  pipeline = RLPipeline(make_config(mode="sync", num_updates=2), env, policy)
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["eta"] == 0 and summary["lag_max"] == 0
  assert pipeline.server.batch_shards == [NUM_SHARDS] * (2 * STEPS)  # the barrier: every batch holds every shard


def test_faulty_shard_is_restarted_and_the_run_goes_on(policy, env):
  faults = {(1, 1): "raise", (2, 4): "nan"}

  def inject(shard_id, step, reward):
    fault = faults.pop((shard_id, step), None)
    if fault == "raise":
      raise RuntimeError("simulator crashed")
    return np.full_like(reward, np.nan) if fault == "nan" else reward

  pipeline = RLPipeline(make_config(num_updates=3), env, policy, fault_injector=inject)
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["version"] == 3
  assert summary["shard_restarts"] == [0, 1, 1]
  assert summary["lag_max"] <= 1


def test_learner_error_stops_every_thread_and_checkpoints(policy, env, tmp_path):
  def failing_at_third_update(update):
    calls = []
    def wrapped(*args):
      calls.append(1)
      if len(calls) == 3:
        raise FloatingPointError("loss became NaN")
      return update(*args)
    return wrapped

  pipeline = RLPipeline(make_config(num_updates=5), env, policy, checkpoint_dir=str(tmp_path / "ckpt"),
                        update_wrapper=failing_at_third_update)
  with pytest.raises(RLRunError, match="loss became NaN"):
    pipeline.run()
  assert_all_joined(pipeline)
  assert RLCheckpointer(str(tmp_path / "ckpt")).latest_version() == 2


def test_stop_request_shuts_down_cleanly_and_checkpoints(policy, env, tmp_path):
  pipeline = RLPipeline(make_config(num_updates=50), env, policy, checkpoint_dir=str(tmp_path / "ckpt"))
  pipeline.learner.on_update = lambda version, *_: version == 2 and pipeline.request_stop("SIGTERM")
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["stop_reason"] == "SIGTERM" and summary["version"] == 2
  assert RLCheckpointer(str(tmp_path / "ckpt")).latest_version() == 2


def test_grpo_groups_share_their_start_and_finished_envs_are_masked(policy, env):
  pipeline = RLPipeline(make_config(algorithm="grpo", group_size=2, num_updates=2, segment_length=4), env, policy)
  batches = []
  gather = pipeline.learner._gather
  pipeline.learner._gather = lambda update: batches.append(gather(update)) or batches[-1]
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["version"] == 2 and summary["lag_max"] <= 1
  for batch in batches:
    first_state = batch["observation"]["observation.state"][0]  # [N, state_dim]
    np.testing.assert_array_equal(first_state[0::2], first_state[1::2])  # each group of 2 starts identically
    np.testing.assert_array_equal(batch["observation"]["task_index"][0, 0::2], batch["observation"]["task_index"][0, 1::2])
    # PointReach ends every episode within 6 actions = 3 steps: once done, an env stays masked out.
    valid = batch["valid"].astype(int)
    assert valid[0].all() and not valid[3].any() and (np.diff(valid, axis=0) <= 0).all()


def test_disaggregated_placement_with_block_fp8_inference_weights(policy, env):
  config = make_config(num_updates=2)
  config.placement.update(env_devices=[1], inference_device=2, learner_devices=[3, 4])
  config.placement.learner_mesh.update(data=1, fsdp=2)
  config.inference_weights = "fp8_block"
  pipeline = RLPipeline(config, env, policy, sharding_rules=SHARDING_RULES)
  summary = pipeline.run()
  assert_all_joined(pipeline)
  assert summary["version"] == 2 and summary["lag_max"] <= 1
  devices = jax.devices()
  learner_leaves = jax.tree.leaves(pipeline.learner.params)
  assert all(leaf.sharding.device_set == {devices[3], devices[4]} for leaf in learner_leaves)
  # FSDP like SFT training: weight matrices are split across the two learner devices, not copied.
  assert any(not leaf.sharding.is_fully_replicated for leaf in learner_leaves if leaf.ndim == 2)
  _, served = pipeline.param_store.latest()
  assert all(leaf.sharding.device_set == {devices[2]} for leaf in jax.tree.leaves(served))
  # The served weight matrices are block-FP8 values: close to, but not exactly, the learner's.
  kernels = [(a, b) for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(pipeline.learner.params)) if a.ndim == 2]
  assert any(not np.array_equal(a, b) for a, b in kernels)
  for a, b in kernels:
    np.testing.assert_allclose(a, b, rtol=0.07, atol=1e-6)


def test_shard_failing_past_max_restarts_stops_the_run(policy, env):
  def always_broken(shard_id, step, reward):
    if shard_id == 0:
      raise RuntimeError("simulator keeps crashing")
    return reward

  pipeline = RLPipeline(make_config(num_updates=3, max_restarts=1), env, policy, fault_injector=always_broken)
  with pytest.raises(RLRunError, match="env shard 0 failed 2 times"):
    pipeline.run()
  assert_all_joined(pipeline)


def test_fixed_shard_tickets_give_each_shard_its_own_segments():
  tickets = SegmentTickets(total_segments=8, segments_per_update=4, eta=0, fixed_shards=[2, 3])
  assert [tickets.take(2), tickets.take(2), tickets.take(3)] == [0, 2, 1]
  tickets.give_back(2)  # a failed segment goes back to the shard that owns it
  assert tickets.take(3) == 3 and tickets.take(2) == 2
  assert [tickets.take(2), tickets.take(2), tickets.take(2)] == [4, 6, None]
  assert not tickets.exhausted() and [tickets.take(3), tickets.take(3), tickets.take(3)] == [5, 7, None]
  assert tickets.exhausted()
  resumed = SegmentTickets(total_segments=8, segments_per_update=4, eta=0, first_ticket=4, fixed_shards=[2, 3])
  assert [resumed.take(3), resumed.take(2)] == [5, 4]


def test_per_env_keys_make_a_sample_independent_of_its_batch(policy, env):
  observation = {key: np.asarray(value) for key, value in
                 jax.vmap(env.reset)(jax.random.split(jax.random.key(0), 8)).obs.items()}
  keys = jax.random.split(jax.random.key(3), 8)
  whole = policy.jit_sample(policy.initial_params, observation, keys)
  halves = [policy.jit_sample(policy.initial_params, {k: v[rows] for k, v in observation.items()}, keys[rows])
            for rows in (slice(0, 4), slice(4, 8))]
  for key in ("actions", "chain", "step_index", "log_prob"):
    np.testing.assert_allclose(np.concatenate([np.asarray(h[key]) for h in halves]), np.asarray(whole[key]),
                               rtol=1e-5, atol=1e-6)
  # One key for the batch (evaluation, warm start) still works, and differs from per-env keys.
  single = policy.jit_sample(policy.initial_params, observation, jax.random.key(3))
  assert not np.allclose(np.asarray(single["actions"]), np.asarray(whole["actions"]))


class _PeerFailsAt(multihost.ProcessGroup):
  """This process alone, but talking to one imaginary peer whose shard fails before update `update`."""

  def __init__(self, update):
    super().__init__()
    self.fail_at, self.sent = update, []

  multi = True

  def exchange(self, name, message):
    self.sent.append((name, message))
    if name == "summary":  # the end of the run: the peer's counters (here: a copy of this process's)
      return [message, message]
    peer_ready = name != f"update/{self.fail_at}"
    return [message, {"ready": peer_ready, "reason": "error: env shard 3 failed 4 times",
                      "statistics": message["statistics"] if peer_ready else None}]

  def announce_stop(self, reason):
    self.sent.append(("stop", reason))

  def peer_stop(self):
    return None


def test_a_peer_that_stops_stops_this_process_before_the_next_update(policy, env, tmp_path, monkeypatch):
  group = _PeerFailsAt(update=2)
  monkeypatch.setattr(multihost, "ProcessGroup", lambda: group)
  config = make_config(num_updates=6)
  config.placement.learner_devices = [0]
  pipeline = RLPipeline(config, env, policy, checkpoint_dir=str(tmp_path / "ckpt"))
  summary = pipeline.run()
  assert_all_joined(pipeline)
  # Updates 0 and 1 ran after both processes reported ready; at update 2 the peer's failure stopped
  # this one before the update, with the peer's reason, and the last good version was saved.
  assert summary["version"] == 2 and summary["stop_reason"] == "process 1: error: env shard 3 failed 4 times"
  assert [name for name, _ in group.sent if name.startswith("update/")] == ["update/0", "update/1", "update/2"]
  assert all(message["ready"] for name, message in group.sent if name.startswith("update/"))
  assert RLCheckpointer(str(tmp_path / "ckpt")).latest_version() == 2
  assert summary["num_processes"] == 2 and summary["env_steps"] == 2 * summary["env_steps_per_process"][0]


def test_optimizer_clips_and_steps_actor_critic_and_perception_apart():
  """Each part's gradients are clipped by their own global norm and stepped at their own rate: a large
  perception (or value) gradient in one step leaves the actor's steps as they would be alone (one shared
  clip would shrink the actor's gradient in that step only, and Adam's next step would differ)."""
  import jax.numpy as jnp
  from ejax.rl.pipeline import make_optimizer
  config = default_config()
  config.update(learning_rate=1e-3, critic_learning_rate=1e-2, perception_learning_rate=1e-1, grad_clip_norm=1.0)
  params = {"actor": {"expert": jnp.ones(3), "perception": {"w": jnp.ones(2)}}, "critic": {"out": jnp.ones(2)}}
  optimizer = make_optimizer(config)

  def steps(perception_grads, critic_grads):
    state, out = optimizer.init(params), []
    for p, c in zip(perception_grads, critic_grads):
      grads = {"actor": {"expert": jnp.full(3, 0.1), "perception": {"w": jnp.full(2, p)}}, "critic": {"out": jnp.full(2, c)}}
      updates, state = optimizer.update(grads, state, params)
      out.append(jax.tree.map(np.asarray, updates))
    return out

  alone = steps([0.0, 0.0], [0.0, 0.0])
  together = steps([1e4, 1.0], [1e3, 1.0])
  for a, b in zip(alone, together):
    np.testing.assert_allclose(b["actor"]["expert"], a["actor"]["expert"], rtol=1e-5)
    np.testing.assert_allclose(b["actor"]["expert"], -1e-3, rtol=1e-3)  # constant gradient: Adam steps lr
  np.testing.assert_allclose(together[0]["actor"]["perception"]["w"], -1e-1, rtol=1e-3)
  np.testing.assert_allclose(together[0]["critic"]["out"], -1e-2, rtol=1e-3)
