"""Packed batches indexed shard by shard: the same numbers as global indexing, and no activation of
the global batch gathered onto a device (ejax/parallel/shard_local.py, attention under shard_map)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from ejax.data.packing import collate_per_shard, concatenate_batches
from ejax.kernels.attention import attention
from ejax.models import groot, pi05
from ejax.models.registry import get_model_spec
from ejax.parallel import batch_sharding, make_mesh, sharding_context
from ejax.train.compile_report import compile_train_step
from ejax.parallel.hlo import collective_summary, collectives
from ejax.parallel.shard_local import set_rows, take_rows
from tests.train.helpers import load_config

RULES = [tuple(rule) for rule in common.SHARDING_RULES]


def test_take_and_set_rows_match_global_indexing_per_shard():
  mesh = make_mesh(dict(data=2, fsdp=4, tensor=1))
  rows_per_shard, samples_per_shard = 3, 5
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8 * rows_per_shard, 4)), jnp.float32)
  # Every sample points at a row of its own shard (what collate_per_shard guarantees).
  shard_of_sample = np.arange(8 * samples_per_shard) // samples_per_shard
  index = jnp.asarray(shard_of_sample * rows_per_shard + rng.integers(0, rows_per_shard, shard_of_sample.size))
  values = jnp.asarray(rng.normal(size=(index.shape[0], 4)), jnp.float32)
  slots = jnp.asarray(np.concatenate([shard * samples_per_shard + rng.permutation(samples_per_shard)
                                      for shard in range(8)]))
  target = jnp.zeros((8 * samples_per_shard, 4))

  def both(x, index, values, slots, target):
    return take_rows(x, index), set_rows(target, slots, values)

  expected = both(x, index, values, slots, target)
  with sharding_context(mesh, RULES):
    jitted = jax.jit(both)
    got = jitted(x, index, values, slots, target)
    text = jitted.lower(x, index, values, slots, target).as_text()
  assert "shard_map" in text or "sdy.manual_computation" in text  # really the per-shard path
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.parametrize("length", [128, 384])  # the dense reference and the XLA tile loops
@pytest.mark.parametrize("kv_heads", [1, 2, 4])   # MQA (kv whole on every tensor device), GQA, MHA
def test_attention_per_shard_matches_unsharded(kv_heads, length):
  mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
  rng = np.random.default_rng(kv_heads)
  q = jnp.asarray(rng.normal(size=(8, length, 4, 16)), jnp.float32)
  k, v, d_out = (jnp.asarray(rng.normal(size=shape), jnp.float32)
                 for shape in ((8, length, kv_heads, 16), (8, length, kv_heads, 16), q.shape))
  segments = jnp.asarray(np.sort(rng.integers(0, 4, (8, length)), axis=1))

  def loss(q, k, v):
    out = attention(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, mask_kind="causal")
    return jnp.sum(out * d_out)

  expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  with sharding_context(mesh, RULES):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)


def _runlocal_model_config(name):
  if name == "groot":
    config = groot.model_config("runlocal")
    config.num_cameras = 1  # the image-token path too
  else:
    config = pi05.model_config("runlocal")
  return config


@pytest.mark.parametrize("name", ["groot", "pi05"])
def test_loss_and_gradients_per_shard_match_unsharded(name):
  config = _runlocal_model_config(name)
  spec = get_model_spec(name)
  # 16 samples packed as the trainer packs them for 8 devices: 2 samples per device, each device's
  # packed into its own rows (collate_per_shard).
  per_device = 2 * int(config.packing.samples_per_row)
  batch = concatenate_batches([spec.example_batch(config, per_device, seed) for seed in range(8)])
  n = batch["actions"].shape[0]
  horizon, action_dim = batch["actions"].shape[1:]
  time = jnp.linspace(0.1, 0.9, n)
  noise = jax.random.normal(jax.random.key(1), (n, horizon, action_dim))
  graphdef, params, rest = nnx.split(spec.create(config, nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, batch):
    model = nnx.merge(graphdef, params, rest)
    value, metrics = model.compute_loss(batch, jax.random.key(2), time=time, noise=noise, train=False)
    return value, metrics["per_sample_loss"]

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (expected_loss, expected_samples), expected_grads = grad(params, batch)
  mesh = make_mesh(dict(data=2, fsdp=4, tensor=1))
  sharded = {k: jax.device_put(v, batch_sharding(mesh, RULES, v.ndim, leading=v.shape[0])) for k, v in batch.items()}
  with sharding_context(mesh, RULES):
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (got_loss, got_samples), got_grads = grad(params, sharded)
  np.testing.assert_allclose(got_samples, expected_samples, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got_loss, expected_loss, rtol=2e-5)
  for got, expected in zip(jax.tree.leaves(got_grads), jax.tree.leaves(expected_grads)):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_collate_per_shard_packs_each_device_alone():
  config = _runlocal_model_config("groot")
  spec = get_model_spec("groot")
  collate = collate_per_shard(lambda seeds: spec.example_batch(config, len(seeds), seeds[0]), 4)
  batch = collate(list(range(8)))
  rows = groot.sample_rows(batch)
  rows_per_shard, samples_per_shard = batch["vl_tokens"].shape[0] // 4, batch["actions"].shape[0] // 4
  np.testing.assert_array_equal(rows // rows_per_shard, np.arange(8) // samples_per_shard)
  with pytest.raises(ValueError, match="does not split over the 4 devices"):
    collate(list(range(6)))


@pytest.mark.slow  # two compiles, ~2 minutes: the 1,024-device memory guard runs with the slow suite (CI budget)
@pytest.mark.parametrize("path", ["configs/groot.py", "configs/pi05.py"])
def test_gathered_bytes_barely_grow_with_the_batch(path):
  # What the trainer's step gathers is weights, plus a few per-sample vectors ([n, width]: GR00T's
  # timestep and auxiliary features, ~3 KB a sample at this size; pi0.5 none). Before shard-local
  # indexing it also gathered the packed rows, image tokens and attention inputs of the whole global
  # batch onto every device: 15 KB a sample here for pi0.5, hundreds of GB per device at 1,024.
  config = load_config(path, "runlocal")
  mesh = make_mesh(dict(data=2, fsdp=4, tensor=1))
  gathered = []
  per_row = int(config.model.packing.samples_per_row)
  sizes = (8 * per_row, 16 * per_row)  # whole rows on every device
  for batch_size in sizes:
    step = compile_train_step(config, mesh, batch_size)
    summary = collective_summary(collectives(step.compiled.as_text(), mesh.size))
    gathered.append(sum(row["buffer_bytes"] for kind, row in summary.items() if kind in ("all-gather", "all-to-all")))
  assert (gathered[1] - gathered[0]) / (sizes[1] - sizes[0]) < 8 * 1024
