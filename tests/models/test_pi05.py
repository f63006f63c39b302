"""pi0.5: packed == one by one, flow-matching training signal, sampling, sizes, freezing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import layers, pi05, pi05_inputs, summary
from ejax.parallel.params import variable_axis_names

BATCH = 6  # two process-local halves of 3


@pytest.fixture(scope="module")
def config():
  return pi05.model_config("runlocal")


@pytest.fixture(scope="module")
def model(config):
  # Host-filled random weights (a jitted init compiles one random program per shape, slow on CPU).
  # Every weight is random, adaRMS included: its zero init would close every expert residual branch
  # and hide bugs behind the gate.
  return layers.host_random_init(nnx.eval_shape(lambda: pi05.create(config, nnx.Rngs(0))), seed=1, stddev=0.1)


def _global_batch(config, pack):
  """Two process-local batches concatenated as the multi-host input pipeline does."""
  local = [pi05_inputs.example_batch(config, BATCH // 2, seed=seed, pack=pack) for seed in (3, 4)]
  return {k: jnp.asarray(np.concatenate([b[k] for b in local])) for k in local[0]}


@pytest.fixture(scope="module")
def batches(config):
  return _global_batch(config, pack=True), _global_batch(config, pack=False)


@nnx.jit
def _loss(model, batch, time, noise):
  return model.compute_loss(batch, jax.random.key(0, impl="rbg"), time=time, noise=noise)


@nnx.jit
def _sample(model, batch, noise):
  return model.sample_actions(batch, jax.random.key(0, impl="rbg"), noise=noise)


def test_packing_really_packs(config, batches):
  packed, alone = batches
  assert packed["prefix_tokens"].shape[0] == 2 * pi05_inputs.rows_for(config, BATCH // 2) < alone["prefix_tokens"].shape[0]
  # No padding inside a packed sample and no tokens for absent cameras.
  per_image = pi05_inputs.patches_per_image(config)
  image_tokens = int(jnp.sum(packed["prefix_is_image"]))
  assert image_tokens % per_image == 0 and image_tokens < BATCH * config.num_cameras * per_image


def test_packed_batch_equals_samples_one_by_one(config, model, batches):
  packed, alone = batches
  rng = np.random.default_rng(0)
  noise = jnp.asarray(rng.normal(size=(BATCH, config.action_horizon, config.action_dim)), jnp.float32)
  time = jnp.asarray(rng.uniform(0.05, 1.0, BATCH), jnp.float32)
  loss_packed, metrics_packed = _loss(model, packed, time, noise)
  loss_alone, metrics_alone = _loss(model, alone, time, noise)
  np.testing.assert_allclose(metrics_packed["per_sample_loss"], metrics_alone["per_sample_loss"], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(loss_packed, loss_alone, rtol=2e-5)
  assert np.all(np.asarray(metrics_packed["per_sample_loss"]) > 0)
  actions_packed = _sample(model, packed, noise)
  actions_alone = _sample(model, alone, noise)
  assert actions_packed.shape == (BATCH, config.action_horizon, config.action_dim)
  np.testing.assert_allclose(actions_packed, actions_alone, rtol=1e-4, atol=1e-5)
  # Sampling used the noise: a different draw gives different actions.
  other = _sample(model, packed, noise + 1.0)
  assert np.abs(np.asarray(other) - np.asarray(actions_packed)).max() > 1e-3


def test_velocity_at_noise_recovers_training_target(config, model, batches):
  # 10-step Euler with the prefix KV cache vs the joint training pass: with time = 1 the training
  # input is pure noise, so the first sampling step's velocity equals the training prediction.
  packed, _ = batches
  rng = np.random.default_rng(1)
  noise = jnp.asarray(rng.normal(size=(BATCH, config.action_horizon, config.action_dim)), jnp.float32)
  ones = jnp.ones((BATCH,), jnp.float32)
  _, metrics = _loss(model, packed, ones, noise)

  @nnx.jit
  def first_velocity(model, batch, x):
    return model.velocity_fn(batch)(x, jnp.ones((x.shape[0],), jnp.float32))

  velocity = first_velocity(model, packed, noise)
  target = noise - packed["actions"]
  mask = packed["action_mask"]
  expected = jnp.sum(jnp.square(velocity - target) * mask, axis=(1, 2)) / jnp.sum(mask, axis=(1, 2))
  np.testing.assert_allclose(metrics["per_sample_loss"], expected, rtol=1e-4)


def test_full_size_component_counts_match_published_and_shard_under_fsdp(config):
  from configs import common
  full = pi05.model_config("full")
  result = summary.summarize(full, {"data": 1, "fsdp": 8, "tensor": 1}, common.SHARDING_RULES, num_devices=8)
  # Every parameter names its axes, and under fsdp=8 none above 4 MiB is fully replicated.
  abstract = summary.abstract_model(full)
  for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    names = variable_axis_names(variable)
    assert names is not None and len(names) == variable.get_value().ndim, path
  assert result["largest_replicated_param"]["bytes"] <= 4 * 2**20, result["largest_replicated_param"]
  counts = result["param_counts"]
  # Gemma-2B (PaliGemma's LLM, HF gemma-2b): 2,506,172,416. Gemma-300M (openpi gemma.py: "311M").
  assert abs(counts["gemma_2b"] - 2_506_172_416) / 2_506_172_416 < 0.02
  assert abs(counts["gemma_300m"] - 311e6) / 311e6 < 0.02
  # SigLIP So400m/14 at 224 px without the pooling head (pi0.5 uses the patch tokens): 412.4M; the
  # "So400m" family name is nominal (0.4B), the released tower is 3 % above it.
  assert abs(counts["siglip_so400m"] - 412.4e6) / 412.4e6 < 0.02
  # ~3.3B in all (openpi / pi0 paper), adaRMS modulation included.
  assert abs(result["total_params"] - 3.3e9) / 3.3e9 < 0.05


def test_trainable_filter_trains_everything_by_default_and_can_freeze(config, model):
  everything = nnx.state(model, nnx.Param)
  trained = nnx.state(model, pi05.trainable_filter(config))
  assert len(jax.tree.leaves(trained)) == len(jax.tree.leaves(everything))
  frozen_config = config.copy_and_resolve_references()
  frozen_config.train_vision = False
  frozen_config.train_llm = False
  trained = nnx.to_flat_state(nnx.state(model, pi05.trainable_filter(frozen_config)))
  paths = ["/".join(map(str, p)) for p, _ in trained]
  assert paths and all(p.startswith(("expert", "action_", "time_mlp")) for p in paths)



def test_flow_sde_log_prob_recomputes_from_the_stored_chain(config, model, batches):
  # The RL learner's path: sample with one stochastic step, then recompute its log-prob from the
  # stored chain with one velocity call (the prefix KV cache filled again, once).
  from ejax.models import flow
  packed, _ = batches
  noise = jnp.asarray(np.random.default_rng(2).normal(size=(BATCH, config.action_horizon, config.action_dim)),
                      jnp.float32)

  @nnx.jit
  def rollout(model, batch, noise):
    return flow.flow_sde_sample(model.velocity_fn(batch), noise, config.num_inference_steps,
                                jax.random.key(5, impl="rbg"), convention="openpi", action_mask=batch["action_mask"])

  @nnx.jit
  def log_prob(model, batch, chain, step_index):
    return flow.flow_sde_log_prob(model.velocity_fn(batch), chain, step_index, convention="openpi",
                                  action_mask=batch["action_mask"])

  sample = rollout(model, packed, noise)
  assert sample.chain.shape == (BATCH, config.num_inference_steps + 1, config.action_horizon, config.action_dim)
  np.testing.assert_allclose(log_prob(model, packed, sample.chain, sample.step_index), sample.log_prob,
                             rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("tokens", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time: 53 s
def test_the_perception_hook_is_wired_and_starts_as_the_released_model(tokens):
  """model.perception on pi0.5: its batch carries the state vector and the module's targets, the loss
  adds the module's own losses, and what it writes into the state's slots joins the action expert's
  conditioning (and with perception_tokens each action token's input) through projections that start
  at zero (the released model's flow loss and actions) and that the flow loss trains."""
  from ejax.models import perception
  c = pi05.model_config("runlocal")
  c.max_state_dim = 4 + 2 + 2 * 2 * 2   # the data's 4, a 2-d estimate, 2 points x 2 cameras x (x, y)
  c.packing.update(max_images_per_sample=2, row_length=256)
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.estimate.update(dim=2, width=16)
  c.perception_tokens = tokens
  model = layers.host_random_init(nnx.eval_shape(lambda: pi05.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  projections = ("perception_cond", "perception_tokens") if tokens else ("perception_cond",)
  assert (pi05.create(c, nnx.Rngs(0)).perception_tokens is None) != tokens
  for projection in projections:
    fresh = getattr(pi05.create(c, nnx.Rngs(0)), projection)   # as initialised: zero
    for name in ("kernel", "bias"):
      assert not np.asarray(getattr(fresh, name)[...]).any()
      getattr(getattr(model, projection), name)[...] = getattr(fresh, name)[...]
  batch = pi05.example_batch(c, 4, seed=3)
  assert batch["state"].shape == (4, 14) and not batch["state"][:, 4:].any()
  assert batch["aux_state"].shape == (4, 2) and batch["aux_pixels"].shape == (4, 8)
  labelled = dict(batch, aux_state=np.full((4, 2), 0.5, np.float32), aux_mask=np.ones(4, np.float32))
  time, noise = jnp.full((4,), 0.5), jnp.asarray(np.random.default_rng(0).normal(size=batch["actions"].shape),
                                                  jnp.float32)
  loss_fn = lambda m, b: m.compute_loss(b, jax.random.key(1), time=time, noise=noise, train=False)
  loss, metrics = nnx.jit(loss_fn)(model, labelled)
  np.testing.assert_allclose(loss, metrics["flow_loss"] + metrics["aux_state_loss"] + metrics["aux_heatmap_loss"],
                             rtol=1e-5)
  grads = nnx.jit(nnx.grad(lambda m, b: loss_fn(m, b)[1]["flow_loss"]))(model, labelled)
  for projection in projections:
    assert float(jnp.abs(getattr(grads, projection).kernel[...]).sum()) > 0
  assert float(jnp.abs(grads.perception.readout_out.kernel[...]).sum()) == 0   # the estimate learns by its own loss
  sampled = nnx.jit(lambda m, b: m.sample_actions(b, jax.random.key(2), noise=noise))(model, batch)
  model.perception = model.perception_cond = model.perception_tokens = nnx.data(None)   # the released model
  np.testing.assert_allclose(nnx.jit(loss_fn)(model, labelled)[1]["flow_loss"], metrics["flow_loss"], rtol=1e-6)
  np.testing.assert_allclose(nnx.jit(lambda m, b: m.sample_actions(b, jax.random.key(2), noise=noise))(model, batch),
                             sampled, rtol=1e-6, atol=1e-6)


def test_continuous_state_reaches_the_action_expert_beside_the_prompt_bins():
  """model.continuous_state: the batch carries the state vector, a projection of it joins every action
  token, and the velocity moves with that vector alone (the prompt's bins held fixed); the flow loss
  trains the projection. Off (as released), the batch has no vector: the state reaches
  the expert only through the prompt."""
  c = pi05.model_config("runlocal")
  assert not c.continuous_state and "state" not in pi05.example_batch(c, 3, seed=3)
  assert pi05.create(c, nnx.Rngs(0)).state_proj is None
  c.continuous_state = True
  model = layers.host_random_init(nnx.eval_shape(lambda: pi05.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  packed = pi05_inputs.example_batch(c, 4, seed=3)
  assert packed["state"].shape == (4, c.max_state_dim)
  noise = jnp.asarray(np.random.default_rng(0).normal(size=packed["actions"].shape), jnp.float32)
  time = jnp.full((4,), 0.7)
  velocity = nnx.jit(lambda m, b: m.velocity_fn(b)(noise, time))
  moved_state = dict(packed, state=packed["state"] + 0.5)
  change = np.abs(np.asarray(velocity(model, moved_state)) - np.asarray(velocity(model, packed))).max(axis=(1, 2))
  assert np.all(change > 1e-3), change
  grads = nnx.jit(nnx.grad(lambda m, b: _loss(m, b, time, noise)[0]))(model, packed)
  assert float(jnp.abs(grads.state_proj.kernel[...]).sum()) > 0


def test_sampling_casts_the_experts_weights_once_not_every_denoising_step():
  """At bf16 compute the expert's stacked f32 layer weights are cast before the denoising loop
  (gemma.layer_weights in velocity_fn), not in its body: XLA:GPU (a compile-only H100) left the cast
  in the loop, once a step (BENCHMARKS.md). Checked on the traced program, so on any backend."""
  c = pi05.model_config("runlocal")
  c.dtype = "bfloat16"
  model = nnx.eval_shape(lambda: pi05.create(c, nnx.Rngs(0)))
  batch = jax.tree.map(jnp.asarray, pi05_inputs.example_batch(c, 2))
  stacked = {tuple(getattr(model.expert.layers, name).get_value().shape)
             for name in ("q_einsum", "kv_einsum", "attn_vec_einsum", "gating_einsum", "linear")}

  def weight_casts(jaxpr) -> int:
    return sum(1 for eqn in jaxpr.eqns if eqn.primitive.name == "convert_element_type"
               and tuple(eqn.invars[0].aval.shape) in stacked and eqn.outvars[0].aval.dtype == jnp.bfloat16)

  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda state, batch: nnx.merge(graphdef, state).sample_actions(batch, jax.random.key(0)))(
      state, batch).jaxpr
  (loop,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("scan", "while")
             and eqn.params.get("length", 0) == c.num_inference_steps or eqn.primitive.name == "while"]
  body = loop.params.get("jaxpr", loop.params.get("body_jaxpr")).jaxpr
  assert any(eqn.primitive.name == "scan" for eqn in body.eqns), "expected the expert's layer scan in the loop"
  assert weight_casts(body) == 0


def test_fp8_runs_the_paligemma_feed_forward_as_fp8_gemms_and_trains_alike(config, batches):
  """model.fp8: the PaliGemma expert's three feed-forward GEMMs (forward and backward) take e4m3 / e5m2
  operands; the loss and its gradient stay close to the unquantised ones (runlocal computes in fp32), the action expert is untouched."""
  packed, _ = batches
  rng = np.random.default_rng(2)
  noise = jnp.asarray(rng.normal(size=(BATCH, config.action_horizon, config.action_dim)), jnp.float32)
  time = jnp.asarray(rng.uniform(0.05, 1.0, BATCH), jnp.float32)
  results = {}
  for fp8 in (False, True):
    c = config.copy_and_resolve_references()
    c.fp8 = fp8
    model = layers.host_random_init(nnx.eval_shape(lambda c=c: pi05.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)

    def loss(model):
      return model.compute_loss(packed, jax.random.key(0, impl="rbg"), time=time, noise=noise)[0]

    graph, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.jit(jax.value_and_grad(lambda p: loss(nnx.merge(graph, p, rest))))
    jaxpr = str(jax.make_jaxpr(grad_fn)(params))
    results[fp8] = grad_fn(params), jaxpr
  (loss_plain, grads_plain), jaxpr_plain = results[False]
  (loss_fp8, grads_fp8), jaxpr_fp8 = results[True]
  assert "f8_e4m3fn" not in jaxpr_plain
  # Per layer scan body: gate, up and down forward in e4m3; dY in e5m2 for the backward GEMMs.
  assert "f8_e4m3fn" in jaxpr_fp8 and "f8_e5m2" in jaxpr_fp8
  np.testing.assert_allclose(loss_fp8, loss_plain, rtol=2e-3)  # 1.5e-4 here
  for name in ("gating_einsum", "linear"):
    a = np.asarray(getattr(grads_plain["llm"]["layers"], name)[...]).ravel()
    b = np.asarray(getattr(grads_fp8["llm"]["layers"], name)[...]).ravel()
    assert np.abs(b).max() > 0 and not np.array_equal(a, b)
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99, name  # 0.997-0.998 here
  # The action expert's feed-forward is not quantised: its gradient sees FP8 only through the prefix.
  a = np.asarray(grads_plain["expert"]["layers"]["linear"][...]).ravel()
  b = np.asarray(grads_fp8["expert"]["layers"]["linear"][...]).ravel()
  assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.95


def test_fp8_impl_is_checked_where_the_model_is_built(config):
  c = config.copy_and_resolve_references()
  c.fp8, c.fp8_impl = True, "fp4"
  with pytest.raises(ValueError, match="model.fp8_impl='fp4'"):
    pi05.create(c, nnx.Rngs(0))
