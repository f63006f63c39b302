"""GR00T-N1.5: packed == unpacked, freezing, parameter counts of the released sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import groot, groot_inputs, layers, summary
from ejax.parallel.axes import EMBED, EMBODIMENT, HEADS, KV_HEADS, MLP, VOCAB
from ejax.parallel.params import variable_axis_names


def tiny_config():
  c = groot.model_config("runlocal")
  c.vision.depth = 1
  c.llm.num_layers = 1
  c.dit.num_layers = 2
  c.num_cameras = 1
  c.remat = "full"  # sampling loops must work with rematerialised blocks (the option that saves memory)
  return c


@pytest.fixture(scope="module")
def model_and_config():
  c = tiny_config()
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  return model, c


def _unpack(batch, c):
  """The same samples, each alone in its own row (no packing)."""
  prompts, images = [], []
  per_sample_images = batch["images"].shape[0] // batch["state"].shape[0]
  rows = groot_inputs.sample_rows(batch)
  for i in range(batch["state"].shape[0]):
    row, segment = rows[i], batch["sample_segment"][i]
    prompts.append(batch["vl_tokens"][row][batch["vl_segment_ids"][row] == segment])
    images.append(batch["images"][i * per_sample_images:(i + 1) * per_sample_images])
  return groot_inputs.assemble(c, prompts, np.concatenate(images), batch["state"], batch["actions"],
                               batch["action_mask"], batch["embodiment_id"], pack=False)


def test_packed_batch_equals_samples_one_by_one(model_and_config):
  model, c = model_and_config
  packed = groot.example_batch(c, 4, seed=3)
  unpacked = _unpack(packed, c)
  assert packed["vl_tokens"].shape[0] == 2 and unpacked["vl_tokens"].shape[0] == 4
  rows = groot_inputs.sample_rows(packed)
  assert (np.bincount(rows) == 2).all()  # two samples really share each row
  time = jnp.array([0.1, 0.4, 0.7, 0.95])
  noise = jax.random.normal(jax.random.key(0), packed["actions"].shape)

  @nnx.jit
  def run(m, b):
    _, metrics = m.compute_loss(b, jax.random.key(1), time=time, noise=noise, train=False)
    return metrics["per_sample_loss"], m.sample_actions(b, jax.random.key(2), noise=noise)

  loss_p, actions_p = run(model, packed)
  loss_u, actions_u = run(model, unpacked)
  assert float(jnp.std(actions_p)) > 1e-3  # the comparison is not between constants
  np.testing.assert_allclose(loss_p, loss_u, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(actions_p, actions_u, rtol=2e-5, atol=2e-5)
  # A sample's result must not depend on its row neighbour: change sample 1's images.
  other = dict(packed, images=packed["images"].copy())
  other["images"][1] = 255 - other["images"][1]
  loss_o, actions_o = run(model, other)
  neighbour = int(np.flatnonzero((rows == rows[1]) & (np.arange(4) != 1))[0])
  np.testing.assert_allclose(loss_o[neighbour], loss_p[neighbour], rtol=2e-5)
  assert not np.allclose(actions_o[1], actions_p[1])


def test_trainable_filter_freezes_llm_and_vision(model_and_config):
  model, c = model_and_config
  trainable = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, groot.trainable_filter(c)))}
  assert trainable and not any("/llm/" in p or "/vision/" in p or "/connector/" in p for p in trainable)
  assert any(p.startswith("action_head/dit/") for p in trainable)
  assert any("vl_self_attention" in p for p in trainable)
  c2 = tiny_config()
  c2.tune_visual = True
  trainable2 = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, groot.trainable_filter(c2)))}
  assert any("/vision/" in p for p in trainable2) and not any("/llm/" in p for p in trainable2)


def test_frozen_towers_run_unrolled_and_trained_ones_scanned():
  """A scan stacks its blocks' weights every step: worth it for trained blocks (one block compiled),
  a copy of unchanging weights for frozen ones, which run unrolled."""
  c = tiny_config()
  c.vision.depth = c.llm.num_layers = layers.MIN_SCANNED
  c.tune_visual = True
  c.scan_layers = True
  model = nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0)))
  assert model.backbone.vision.scan_layers and not model.backbone.llm.scan_layers
  c.scan_layers = False
  assert not nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))).backbone.vision.scan_layers


def _released_counts():
  """Parameter counts written out from the released GR00T-N1.5-3B shapes (config.json + Eagle 2.5)."""
  lin = lambda i, o: i * o + o
  dit_block_self = lin(1536, 3072) + 4 * lin(1536, 1536) + lin(1536, 6144) + lin(6144, 1536)
  dit_block_cross = dit_block_self + 2 * (lin(2048, 1536) - lin(1536, 1536))
  dit = 8 * dit_block_self + 8 * dit_block_cross + lin(256, 1536) + lin(1536, 1536) + lin(1536, 3072) + lin(1536, 1024)
  vl = 4 * (4 * 2048 + 4 * lin(2048, 2048) + lin(2048, 8192) + lin(8192, 2048)) + 2 * 2048
  per_embodiment = 32 * (lin(64, 1024) + lin(1024, 1536) + lin(32, 1536) + lin(3072, 1536) + lin(1536, 1536)
                         + lin(1024, 1024) + lin(1024, 32))
  llm_layer = 2048 * 2048 * 2 + 2048 * 1024 * 2 + 3 * 2048 * 6144 + 2 * 128 + 2 * 2048
  llm = 151680 * 2048 + 12 * llm_layer + 2048
  vision = (27 * (4 * lin(1152, 1152) + lin(1152, 4304) + lin(4304, 1152) + 4 * 1152)
            + lin(14 * 14 * 3, 1152) + 256 * 1152 + 2 * 1152)
  return {"dit": dit, "vl_self_attention": vl, "per_embodiment": per_embodiment, "llm": llm, "vision": vision,
          "connector": lin(1152, 2048), "action_head_embeddings": 32 * 1536 + 1024 * 1536}


RULES = [(EMBED, "fsdp"), (MLP, "tensor"), (HEADS, "tensor"), (KV_HEADS, "tensor"), (VOCAB, "tensor"),
         (EMBODIMENT, None)]


def test_full_size_counts_match_the_release_and_published_figures():
  s = summary.summarize(groot.model_config("full"), {"fsdp": 8}, RULES, num_devices=8)
  counts = s["param_counts"]
  assert counts == _released_counts()
  published = {"dit": 0.55e9, "vl_self_attention": 0.20e9, "per_embodiment": 0.32e9, "llm": 0.92e9}
  for name, figure in published.items():
    assert abs(counts[name] - figure) / figure < 0.02, (name, counts[name])
  # "SigLIP2 ~0.4B" is the So400m family name; the released 27-layer tower without the pooling
  # head has 412.4M parameters (3 % above the nominal figure).
  assert abs(counts["vision"] - 0.4e9) / 0.4e9 < 0.035
  assert 2.35e9 < s["total_params"] < 2.45e9
  # Full fsdp=8 sharding: each device holds about an eighth, nothing big is replicated.
  assert s["total_param_bytes_per_device"] < 1.02 * s["total_params"] * 4 / 8
  assert s["largest_replicated_param"]["bytes"] < 4 * 2**20
  assert s["trainable_params"] == counts["dit"] + counts["vl_self_attention"] + counts["per_embodiment"] + \
      counts["action_head_embeddings"]


def test_every_parameter_has_axis_names():
  abstract = nnx.eval_shape(lambda: groot.create(tiny_config(), nnx.Rngs(0)))
  for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    names = variable_axis_names(variable)
    assert names is not None and len(names) == len(variable.get_value().shape), path


def test_fp8_routes_the_trained_feed_forwards_and_keeps_parameter_paths():
  from ejax.kernels.fp8.dense import Fp8Dense
  from ejax.models.io.tensors import param_shapes
  c = tiny_config()
  c.fp8 = True
  fp8 = nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0)))
  plain = nnx.eval_shape(lambda: groot.create(tiny_config(), nnx.Rngs(0)))
  assert isinstance(fp8.action_head.dit.blocks[0].ff.fc1, Fp8Dense)
  assert isinstance(fp8.action_head.vl_self_attention.blocks[0].ff.fc2, Fp8Dense)
  assert param_shapes(fp8) == param_shapes(plain)


def test_fp8_loss_stays_close_to_full_precision(model_and_config):
  from ejax.models.io import tensors
  model, c = model_and_config
  c8 = tiny_config()
  c8.fp8 = True
  fp8 = tensors.fill_model(nnx.eval_shape(lambda: groot.create(c8, nnx.Rngs(0))), tensors.model_arrays(model))
  batch = groot.example_batch(c, 4, seed=3)
  time = jnp.array([0.1, 0.4, 0.7, 0.9])
  noise = jax.random.normal(jax.random.key(0), batch["actions"].shape)
  run = nnx.jit(lambda m, b: m.compute_loss(b, jax.random.key(1), time=time, noise=noise, train=False)[0])
  full, quantised = float(run(model, batch)), float(run(fp8, batch))
  assert full != quantised and abs(quantised - full) / full < 0.05


def test_summary_job_prints_components_and_writes_json(tmp_path, capsys):
  import json
  import ml_collections
  config = ml_collections.ConfigDict(dict(model=tiny_config(), mesh=dict(data=2, fsdp=4, tensor=1),
                                          sharding_rules=[list(r) for r in RULES]))
  result = summary.run_job(config, str(tmp_path))
  out = capsys.readouterr().out
  for name in groot.COMPONENTS:
    assert name in out
  assert "data=2 x fsdp=4 x tensor=1" in out
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["total_params"] == result["total_params"] == sum(result["param_counts"].values())
  assert saved["total_param_bytes_per_device"] < 4 * saved["total_params"]
