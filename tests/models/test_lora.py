"""LoRA (ejax.models.lora): openpi's adapter math and key layout for pi0.5's Gemma decoders, adapters
on GR00T's transformers, merging without changing the function, and what trains."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import gemma, layers, lora, pi05, pi05_inputs
from ejax.models.io import pi05_openpi
from ejax.models.registry import get_model_spec

# openpi's gemma_2b_lora / gemma_300m_lora settings, at runlocal sizes.
PI05_LORA = {"llm": {"rank": 4, "alpha": 4.0, "targets": "attn,ffn"},
             "expert": {"rank": 8, "alpha": 16.0, "targets": "attn,ffn"}}


def _config(name, adapters):
  if name == "pi05":
    config = pi05.model_config("runlocal")
  else:
    from ejax.models import groot
    config = groot.model_config("runlocal")
  config.lora = adapters
  return config


def _random_model(config, seed=1):
  spec = get_model_spec(config.name)
  return layers.host_random_init(nnx.eval_shape(lambda: spec.create(config, nnx.Rngs(0))), seed=seed, stddev=0.1)


def _openpi_lora(eqn, x, w, a, b, scale):
  """openpi lora.Einsum's forward, rebuilt from its rule: the label of the weight's last axis becomes
  "L" in a (and the output), the label of its second-to-last axis becomes "L" in b."""
  lhs, rhs, out = re.match("(.*),(.*)->(.*)", eqn).groups()
  a_label, b_label = rhs[-2], rhs[-1]
  a_rhs, a_out = rhs.replace(b_label, "L"), out.replace(b_label, "L")
  low = jnp.einsum(f"{lhs},{a_rhs}->{a_out}", x, a)
  return jnp.einsum(eqn, x, w) + jnp.einsum(f"{a_out},{rhs.replace(a_label, 'L')}->{out}", low, b) * scale


@pytest.mark.parametrize("name, eqn, x_shape, w_shape, index", [
    ("q_einsum", "BTD,NDH->BTNH", (2, 5, 6), (3, 6, 4), None),
    ("kv_einsum", "BSD,CKDH->CBSKH", (2, 5, 6), (2, 1, 6, 4), None),
    ("attn_vec_einsum", "BTNH,NHD->BTD", (2, 5, 3, 4), (3, 4, 6), None),
    ("gating_einsum", "BTD,DF->BTF", (2, 5, 6), (2, 6, 7), 1),
    ("linear", "BTF,FD->BTD", (2, 5, 7), (7, 6), None),
])
def test_gemma_adapters_compute_openpis_lora(name, eqn, x_shape, w_shape, index):
  rng = np.random.default_rng(0)
  rank, scale = 3, 0.5
  lead = w_shape[:1] if index is not None else ()
  per = w_shape[1:] if index is not None else w_shape
  a_shape = lead + per[:-1] + (rank,)
  b_shape = lead + per[:-2] + (rank,) + per[-1:]
  x, w, a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (x_shape, w_shape, a_shape, b_shape))
  layer = {name: w, "lora": {f"{name}_a": a, f"{name}_b": b}, "lora_scale": jnp.asarray(scale)}
  got = gemma.project(layer, name, eqn, x, index)
  pick = (lambda t: t[index]) if index is not None else (lambda t: t)
  np.testing.assert_allclose(got, _openpi_lora(eqn, x, pick(w), pick(a), pick(b), scale), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pi05_lora():
  config = _config("pi05", PI05_LORA)
  batch = {k: jnp.asarray(v) for k, v in pi05_inputs.example_batch(config, 3, seed=2).items()}
  return config, _random_model(config), batch


@nnx.jit
def _jit_loss(model, batch):
  noise = jax.random.normal(jax.random.key(5), batch["actions"].shape, jnp.float32)
  time = jnp.full((batch["actions"].shape[0],), 0.4)
  return model.compute_loss(batch, jax.random.key(0), time=time, noise=noise)[0]


def _loss(model, batch):
  return float(_jit_loss(model, batch))


def test_pi05_adapters_are_openpis_shapes_and_merge_to_the_same_function(pi05_lora):
  config, model, batch = pi05_lora
  llm = model.llm.layers.lora
  assert llm.q_einsum_a.shape == (2, 2, 64, 4) and llm.q_einsum_b.shape == (2, 2, 4, 16)  # [L, N, D, r], [L, N, r, H]
  assert llm.linear_a.shape == (2, 128, 4) and llm.linear_b.shape == (2, 4, 64)
  assert model.expert.layers.lora.scale == 2.0  # alpha / rank
  with_adapters = _loss(model, batch)
  merged = lora.merge(nnx.clone(model))
  assert not lora.has_adapters(merged) and lora.has_adapters(model)
  plain = nnx.eval_shape(lambda: pi05.create(pi05.model_config("runlocal"), nnx.Rngs(0)))
  assert jax.tree.structure(nnx.to_pure_dict(nnx.state(merged, nnx.Param))) == \
      jax.tree.structure(nnx.to_pure_dict(nnx.state(plain, nnx.Param)))
  np.testing.assert_allclose(_loss(merged, batch), with_adapters, rtol=2e-5)


def test_a_fresh_adapter_starts_at_the_weights_it_adapts():
  config = _config("pi05", PI05_LORA)
  with layers.deferred_init() as records:
    adapted = get_model_spec("pi05").create(config, nnx.Rngs(0))
  with layers.deferred_init() as plain_records:
    plain = pi05.create(pi05.model_config("runlocal"), nnx.Rngs(0))
  # The base weights draw the same keys with or without adapters (adapters are drawn after them)...
  def inits(model, records):  # path -> DeferredInit (nnx.split keeps the recorded Variables)
    _, state, _ = nnx.split(model, nnx.Param, ...)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {tuple(str(k.key) for k in path): records[id(var)][1] for path, var in leaves
            if id(var) in records}  # norms made with their values (zeros) have no record

  def keys(model, records):
    return {path: np.asarray(jax.random.key_data(init.key)) for path, init in inits(model, records).items()}
  base, with_adapters = keys(plain, plain_records), keys(adapted, records)
  assert set(base) < set(with_adapters)
  for path, key in base.items():
    np.testing.assert_array_equal(with_adapters[path], key)
  # ...and b starts at zero, so the adapted model computes the base model's function.
  adapted_inits = inits(adapted, records)
  assert adapted_inits[("llm", "layers", "lora", "q_einsum_b")].init is lora.B_INIT
  assert adapted_inits[("expert", "layers", "lora", "linear_a")].init is lora.A_INIT


def test_only_adapters_and_unadapted_modules_train(pi05_lora):
  config, model, _ = pi05_lora
  trainable = get_model_spec("pi05").trainable_filter(config)
  trained = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, trainable))}
  assert any("/lora/" in p for p in trained) and any(p.startswith("vision/") for p in trained)
  assert not [p for p in trained if p.startswith(("llm/", "expert/")) and "/lora/" not in p]
  adapters = lora.count(model)
  total = sum(int(np.size(v.get_value())) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  llm_and_expert = sum(int(np.size(v.get_value())) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
                       if path[0] in ("llm", "expert") and "lora" not in path)
  # Trained: everything but the adapted decoders' own weights (the adapters are in `total`).
  assert 0 < adapters < llm_and_expert / 2 and total - llm_and_expert == sum(
      int(np.size(v.get_value())) for _, v in nnx.to_flat_state(nnx.state(model, trainable)))


def test_openpi_lora_checkpoints_round_trip_and_export_merged(pi05_lora):
  config, model, batch = pi05_lora
  tree = pi05_openpi.export_params(model)
  assert tree["PaliGemma/llm/layers/attn/q_einsum/lora_a"].shape == (2, 2, 64, 4)
  assert tree["PaliGemma/llm/layers/attn/attn_vec_einsum_1/lora_b"].shape == (2, 2, 8, 32)
  assert tree["PaliGemma/llm/layers/mlp_1/gating_einsum_lora_a"].shape == (2, 2, 32, 8)
  back = pi05_openpi.import_params(config, pi05_openpi.nest(tree))
  np.testing.assert_allclose(_loss(back, batch), _loss(model, batch), rtol=1e-6)
  # A released (adapter-free) checkpoint imports into a LoRA config without adapters to fill.
  merged_tree = pi05_openpi.export_params(lora.merge(nnx.clone(model)))
  assert not [key for key in merged_tree if "lora" in key]
  released = pi05_openpi.import_params(config, merged_tree)
  np.testing.assert_allclose(_loss(released, batch), _loss(model, batch), rtol=2e-5)


def test_groot_adapters_on_the_dit_and_llm_merge_to_the_same_function():
  from ejax.models import groot
  config = _config("groot", {"dit": {"rank": 4, "alpha": 8.0}, "llm": {"rank": 2, "targets": "attn"}})
  model = _random_model(config)
  projections = [node for _, node in nnx.iter_modules(model) if isinstance(getattr(node, "lora", None), lora.Adapter)]
  dit_blocks, llm_blocks = config.dit.num_layers, config.llm.num_layers
  # DiT: q, k, v, o and the feed-forward's two layers per block; LLM: q, k, v, o per block.
  assert len(projections) == 6 * dit_blocks + 4 * llm_blocks
  batch = {k: jnp.asarray(v) for k, v in groot.example_batch(config, 2, seed=3).items()}
  before = _loss(model, batch)
  np.testing.assert_allclose(_loss(lora.merge(model), batch), before, rtol=2e-5)
  assert not lora.has_adapters(model)


@pytest.mark.slow  # CI time (2026-12-01): 64 s; pi0.5's adapters' gradients and GR00T's merge stay in CI
def test_groot_llm_adapters_get_gradients_through_the_frozen_backbone():
  """With the LLM frozen (tune_llm False) GR00T skips the backbone's backward, unless adapters on it
  train: their b (zero at the start) gets a gradient, as the DiT's does."""
  config = _config("groot", {"dit": {"rank": 4}, "llm": {"rank": 2, "targets": "attn,ffn"}})
  config.update(tune_llm=False, tune_visual=False)
  from ejax.models import groot
  model = _random_model(config)
  batch = {k: jnp.asarray(v) for k, v in groot.example_batch(config, 2, seed=3).items()}
  graphdef, adapters, rest = nnx.split(model, nnx.All(nnx.Param, nnx.PathContains(lora.LORA)), ...)
  noise = jax.random.normal(jax.random.key(5), batch["actions"].shape, jnp.float32)
  time = jnp.full((batch["actions"].shape[0],), 0.4)
  loss = lambda a: nnx.merge(graphdef, a, rest).compute_loss(batch, jax.random.key(0), time=time, noise=noise)[0]
  grads = jax.grad(loss)(adapters)
  norms = {"/".join(map(str, path)): float(jnp.linalg.norm(v.get_value())) for path, v in nnx.to_flat_state(grads)
           if path[-1] == "b"}
  llm = [name for name in norms if "llm" in name]
  assert llm and all(norms[name] > 0 for name in llm), norms
  assert all(norms[name] > 0 for name in norms if "dit" in name)


def test_pi05_vision_adapters_get_gradients_through_the_frozen_tower():
  """pi0.5 skips a frozen vision tower's backward (train_vision off), unless adapters on it train."""
  config = _config("pi05", {"vision": {"rank": 2, "targets": "attn"}})
  config.train_vision = False
  model = _random_model(config)
  batch = {k: jnp.asarray(v) for k, v in pi05.example_batch(config, 2, seed=3).items()
           if getattr(v, "dtype", object) != object}
  graphdef, adapters, rest = nnx.split(model, nnx.All(nnx.Param, nnx.PathContains(lora.LORA)), ...)
  noise = jax.random.normal(jax.random.key(5), batch["actions"].shape, jnp.float32)
  time = jnp.full((batch["actions"].shape[0],), 0.4)
  loss = lambda a: nnx.merge(graphdef, a, rest).compute_loss(batch, jax.random.key(0), time=time, noise=noise)[0]
  grads = jax.grad(loss)(adapters)
  norms = [float(jnp.linalg.norm(v.get_value())) for path, v in nnx.to_flat_state(grads) if path[-1] == "b"]
  assert norms and all(n > 0 for n in norms)


def test_bad_lora_settings_name_the_fix():
  with pytest.raises(ValueError, match="model.lora.vision_tower: the model has no submodule"):
    _random_model(_config("pi05", {"vision_tower": {"rank": 4}}))
  with pytest.raises(ValueError, match="targets"):
    lora.settings(_config("pi05", {"llm": {"rank": 4, "targets": "attention"}}))


def test_the_summary_counts_openpis_pi05_lora_and_the_state_a_device_holds():
  import sys
  sys.path.insert(0, ".")
  from configs import common
  from ejax.models import summary
  from ejax.train.compile_report import load_config_file
  config = load_config_file("configs/pi05.py", "lora")
  result = summary.summarize(config.model, {"data": 1, "fsdp": 1, "tensor": 1}, common.SHARDING_RULES,
                             num_devices=1, train=config.train)

  def per_layer(width, mlp, heads, head_dim, rank):  # openpi's adapter shapes, layer by layer
    return rank * (heads * width + heads * head_dim      # q_einsum: [N, D, r], [N, r, H]
                   + 2 * width + 2 * head_dim              # kv_einsum (1 kv head): [2, 1, D, r], [2, 1, r, H]
                   + heads * head_dim + heads * width      # attn_vec_einsum: [N, H, r], [N, r, D]
                   + 2 * width + 2 * mlp                   # gating_einsum: [2, D, r], [2, r, F]
                   + mlp + width)                          # linear: [F, r], [r, D]
  adapters = 18 * (per_layer(2048, 16_384, 8, 256, 16) + per_layer(1024, 4096, 8, 256, 32))
  assert result["lora_params"] == adapters == 49_987_584
  counts = result["param_counts"]
  frozen = result["total_params"] - result["trainable_params"]
  # Frozen: both Gemma decoders (adaRMS included) less their adapters; trained: SigLIP, the
  # projections and the adapters (openpi's freeze filter).
  assert frozen == counts["gemma_2b"] + counts["gemma_300m"] + counts["gemma_300m_adarms"] - adapters
  assert result["trainable_params"] == (counts["siglip_so400m"] + counts["vision_projection"]
                                        + counts["action_time_projections"] + adapters)
  state = result["train_state_bytes_per_device"]
  assert state["frozen"] == 2 * frozen and state["ema"] == 0  # bf16, no EMA (openpi's LoRA recipe)
  assert state["trained"] == 4 * result["trainable_params"] and state["optimizer"] == 8 * result["trainable_params"]
