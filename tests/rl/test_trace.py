"""Trace-driven RL-VLA3 (ejax.rl.trace): empirical delays, the bound a trace allows, the replay wiring."""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx

from ejax.rl.delays import DelaySampler, DelaySpec, delay_spec_from_config, ideal_async_speedup
from ejax.rl.pipeline import RLPipeline, default_config
from ejax.rl.point_env import PointReach
from ejax.rl.policy import mlp_flow_policy
from ejax.rl.trace import Replay, Setting, Trace, speedup_bound

pytestmark = pytest.mark.timeout(300)


def make_trace(env_ms: dict[str, list[float]], inference_ms: dict[int, list[float]], learner_ms: list[float],
               samples: int) -> Trace:
  return Trace({"version": 1, "recorded": {"date": "test"}, "env": {
      task: {"no_cameras": {"chunk_ms": chunk, "resets": [0] * len(chunk), "episode_length": [8]},
             "cameras": {"chunk_ms": [10 * x for x in chunk], "resets": [0] * len(chunk), "episode_length": [8]}}
      for task, chunk in env_ms.items()},
      "actors": {"toy": {"inference_ms": {str(k): v for k, v in inference_ms.items()},
                         "learner": {"samples": samples, "update_ms": learner_ms}}}})


def test_empirical_delay_replays_the_recorded_distribution():
  recorded = [0.01, 0.02, 0.02, 0.05, 0.2]
  spec = delay_spec_from_config({"kind": "empirical", "samples": recorded})  # a list, as configs hold it
  assert spec.samples == tuple(recorded) and spec.expected() == pytest.approx(np.mean(recorded))
  draws = DelaySampler(spec, seed=3).sample(50_000)
  assert set(np.unique(draws)) <= set(recorded)
  for value in set(recorded):  # each recorded value with its recorded frequency
    assert np.mean(draws == value) == pytest.approx(recorded.count(value) / len(recorded), abs=0.01)
  quantiles = [0.1, 0.5, 0.7, 0.9]
  assert list(np.quantile(draws, quantiles, method="inverted_cdf")) == list(
      np.quantile(recorded, quantiles, method="inverted_cdf"))
  assert isinstance(DelaySampler(spec, seed=0).sample(), float)
  with pytest.raises(ValueError):
    DelaySpec(kind="empirical")
  with pytest.raises(ValueError):
    DelaySpec(kind="empirical", samples=(0.1, -0.1))


def test_trace_units_and_scaling():
  trace = make_trace({"a": [100.0, 300.0]}, {2: [5.0], 4: [8.0]}, [40.0, 60.0], samples=16)
  assert trace.env_seconds("a", cameras=False) == pytest.approx([0.1, 0.3])
  assert trace.env_seconds("a", cameras=True) == pytest.approx([1.0, 3.0])
  assert trace.inference_seconds("toy", 4) == pytest.approx([0.008])
  assert trace.inference_seconds("toy", 3) == pytest.approx([0.008])  # the next recorded size up
  assert trace.inference_seconds("toy", 8) == pytest.approx([0.016])  # beyond the largest: linear
  assert trace.learner_seconds("toy", 32) == pytest.approx([0.08, 0.12])
  with pytest.raises(KeyError):
    trace.env_seconds("b", cameras=False)


def test_bound_on_a_hand_computable_trace():
  # 2 shards x 2 envs, 2-step segments, 2 segments per update, 3 updates; constant stage times:
  # env 100 ms, inference of the full batch (4) 50 ms, learner 200 ms.
  trace = make_trace({"a": [100.0]}, {2: [50.0], 4: [50.0]}, [200.0], samples=8)
  setting = Setting("hand", actor="toy", cameras=False, tasks=("a",), placement="separated", num_shards=2,
                    envs_per_shard=2, segment_length=2, segments_per_update=2, full_batch_only=True)
  bound = speedup_bound(trace, setting, num_updates=3, samples=1000)
  # sync: per update 1 round of segments x 2 steps x (50 + 100 ms) + 200 ms = 0.5 s; 1.5 s in all.
  assert bound["sync_seconds"] == pytest.approx(1.5)
  # async: a shard step takes >= 100 + 50 ms (its own inference), 2 shards collect 4 steps in 0.3 s;
  # the server needs 4 x 50 / 2 = 0.1 s; the learner 0.2 s. Env-bound: 3 x 0.3 + 0.2 = 1.1 s.
  assert bound["env_update_seconds"] == pytest.approx(0.3)
  assert bound["server_update_seconds"] == pytest.approx(0.1)
  assert bound["async_seconds"] == pytest.approx(1.1) and bound["limit"] == "env shards"
  assert bound["bound"] == pytest.approx(1.5 / 1.1)
  # One device for inference and learner: 3 x (0.1 + 0.2) = 0.9 s < 1.1 s, still env-bound.
  colocated = speedup_bound(trace, dataclasses.replace(setting, placement="colocated"), 3,
                            samples=1000)
  assert colocated["async_seconds"] == pytest.approx(1.1)
  # A learner of 600 ms: learner-bound, 0.3 + 3 x 0.6 = 2.1 s against 3 x (0.3 + 0.6) = 2.7 s; colocated
  # the device does 3 x (0.1 + 0.6) = 2.1 s too.
  slow = make_trace({"a": [100.0]}, {2: [50.0], 4: [50.0]}, [600.0], samples=8)
  learner_bound = speedup_bound(slow, setting, 3, samples=1000)
  assert learner_bound["limit"] == "learner" and learner_bound["bound"] == pytest.approx(2.7 / 2.1)
  # 3 segments per update over 2 shards: a full round, then shard 0 alone (a batch of 2, its own step).
  uneven = speedup_bound(trace, dataclasses.replace(setting, segments_per_update=3, full_batch_only=False), 3,
                         samples=1000)
  assert uneven["sync_update_seconds"] == pytest.approx(2 * (0.05 + 0.1) + 2 * (0.05 + 0.1) + 0.2 * 12 / 8)
  # Buckets: with 16 envs per shard and every size padded to the full batch, I_min is the full batch's.
  assert Setting("x", num_shards=4, envs_per_shard=16).buckets == [64]
  assert Setting("x", num_shards=4, envs_per_shard=16, full_batch_only=False).buckets == [16, 32, 64]


def test_bound_reduces_to_max_over_mean_without_inference_and_learner():
  samples = list(np.random.default_rng(0).lognormal(np.log(50.0), 1.0, 400))
  trace = make_trace({"a": samples}, {4: [0.0], 8: [0.0], 16: [0.0]}, [0.0], samples=8)
  setting = Setting("x", actor="toy", cameras=False, tasks=("a",), num_shards=4, envs_per_shard=4,
                    segment_length=2, segments_per_update=4)
  bound = speedup_bound(trace, setting, num_updates=1000, samples=200_000)
  ideal = ideal_async_speedup(trace.shard_specs(setting), samples=200_000)
  assert bound["bound"] == pytest.approx(ideal, rel=0.01)
  assert bound["env_max_over_mean"] == pytest.approx(ideal, rel=0.01)


def test_replay_drives_a_real_pipeline_with_the_traced_times():
  """Sync and async on a tiny trace: the same work, every stage at least its traced time, shards of a
  slow and a fast task, and asynchrony gaining what the trace says it can."""
  policy = mlp_flow_policy(state_dim=4, action_dim=2, horizon=2, num_tasks=4, num_steps=2, hidden=16, rngs=nnx.Rngs(0))
  env = PointReach(num_tasks=4, state_dim=4, action_dim=2, max_steps=6)
  trace = make_trace({"slow": [30.0, 60.0], "fast": [5.0]}, {4: [4.0], 8: [6.0]}, [30.0], samples=2 * 3 * 4)
  setting = Setting("tiny", actor="toy", cameras=False, tasks=("slow", "fast"), placement="colocated",
                    num_shards=2, envs_per_shard=4, segment_length=3, segments_per_update=2, eta=2)
  updates = 6

  def make_config(mode, replay, num_updates):
    config = default_config()
    config.update(mode=mode, eta=setting.eta, num_shards=2, envs_per_shard=4, segment_length=3, actions_per_step=2,
                  segments_per_update=2, num_updates=num_updates, num_minibatches=2, num_epochs=1, queue_size=4,
                  inference_full_batch_only=setting.full_batch_only, shard_delays=replay.shard_delays())
    return config

  for mode in ("sync", "async"):  # compilation outside the timed runs
    config = make_config(mode, Replay(trace, setting), 2)
    config.shard_delays = []
    RLPipeline(config, env, policy).run()
  summaries = {}
  for mode in ("sync", "async"):
    replay = Replay(trace, setting)
    pipeline = RLPipeline(make_config(mode, replay, updates), env, replay.policy(policy),
                          update_wrapper=replay.update_wrapper)
    summaries[mode] = pipeline.run()
    assert pipeline.shards[0].delay.spec.samples == pytest.approx((0.03, 0.06))
    assert pipeline.shards[1].delay.spec.samples == pytest.approx((0.005,))
    assert len(replay.learner_calls) == updates and min(replay.learner_calls) >= 0.03
    assert replay.inference_calls and all(size == 8 and seconds >= 0.006 for size, seconds in replay.inference_calls)
    assert summaries[mode]["lag_max"] <= (0 if mode == "sync" else setting.eta)
  assert summaries["sync"]["env_steps"] == summaries["async"]["env_steps"] == updates * 2 * 3 * 4 * 2
  ratio = summaries["async"]["env_steps_per_s"] / summaries["sync"]["env_steps_per_s"]
  bound = speedup_bound(trace, setting, updates)["bound"]
  print(f"replay: async/sync {ratio:.2f}x, bound {bound:.2f}x")
  assert 1.0 < bound < 4.0 and math.isfinite(ratio)
  assert 1.0 < ratio < 1.3 * bound  # the fast shard keeps collecting while the slow one steps
