"""GR00T-N1.5: packed == unpacked, freezing, parameter counts of the released sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import groot, groot_inputs, layers, summary
from ejax.models.siglip import normalize_images
from ejax.parallel.axes import EMBED, EMBODIMENT, HEADS, KV_HEADS, MLP, VOCAB
from ejax.parallel.params import variable_axis_names


def tiny_config():
  c = groot.model_config("runlocal")
  c.vision.depth = 1
  c.llm.num_layers = 1
  c.dit.num_layers = 2
  c.num_cameras = 1
  c.remat = "full"  # as at full size: sampling loops must work with rematerialised blocks
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


def test_auxiliary_state_target_adds_a_masked_regression_to_the_loss():
  c = tiny_config()
  c.update(aux_state_dim=3, aux_loss_weight=0.5, tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  assert batch["aux_state"].shape == (4, 3) and not batch["aux_mask"].any()  # no target: nothing to learn
  target = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
  labelled = dict(batch, aux_state=target, aux_mask=np.array([1, 1, 0, 1], np.float32))
  time, noise = jnp.full((4,), 0.5), jnp.zeros(batch["actions"].shape)

  @nnx.jit  # jitted: op by op, this tiny model's loss and gradient took a minute on 2 cores
  def loss(m, b):
    return m.compute_loss(b, jax.random.key(1), time=time, noise=noise, train=False)

  readout = nnx.jit(lambda m, b: m.action_head.aux_state(m.context(b)[0], b))
  total, metrics = loss(model, labelled)
  predicted = readout(model, labelled)
  expected = np.mean((np.asarray(predicted) - target) ** 2, axis=-1)[[0, 1, 3]].mean()
  np.testing.assert_allclose(metrics["aux_state_loss"], expected, rtol=1e-5)
  np.testing.assert_allclose(total, metrics["flow_loss"] + 0.5 * expected, rtol=1e-5)
  unlabelled_total, unlabelled = loss(model, batch)
  np.testing.assert_allclose(unlabelled_total, unlabelled["flow_loss"], rtol=1e-6)
  # The target trains the head and the VL path (vision tower included), and not the DiT.
  grads = nnx.jit(nnx.grad(lambda m: loss(m, labelled)[1]["aux_state_loss"]))(model)
  assert float(jnp.abs(grads.action_head.aux_state_out.kernel[...]).sum()) > 0
  assert float(jnp.abs(grads.backbone.vision.patch_embedding.kernel[...]).sum()) > 0
  assert float(jnp.abs(grads.action_head.dit.proj_out_2.kernel[...]).sum()) == 0
  # Each sample's readout is the mean over its own VL tokens only (packed rows hold two samples).
  unpacked = _unpack(labelled, c)
  assert unpacked["vl_tokens"].shape[0] == 4 and labelled["vl_tokens"].shape[0] == 2
  np.testing.assert_allclose(readout(model, unpacked), predicted, rtol=1e-4, atol=1e-5)
  # Sampling never looks at it.
  sample = nnx.jit(lambda m, b: m.sample_actions(b, jax.random.key(2), noise=noise))
  a, b = sample(model, batch), sample(model, labelled)
  np.testing.assert_array_equal(a, b)


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


def test_fp8_routes_the_dit_feed_forward_and_keeps_parameter_paths():
  from ejax.kernels.fp8.dense import Fp8Dense
  from ejax.models.io.tensors import param_shapes
  c = tiny_config()
  c.fp8 = True
  fp8 = nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0)))
  plain = nnx.eval_shape(lambda: groot.create(tiny_config(), nnx.Rngs(0)))
  assert isinstance(fp8.action_head.dit.blocks[0].ff.fc1, Fp8Dense)
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


def test_auxiliary_estimate_feeds_the_state_token_when_asked():
  c = tiny_config()
  c.update(aux_state_dim=2, tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  batch["state"][:, -2:] = 0.0
  vl, plain = model.context(batch)
  model.config.aux_state_input = True
  vl_fed, fed = model.context(batch)
  np.testing.assert_array_equal(vl, vl_fed)
  estimate = np.asarray(model.action_head.aux_state(vl, batch))
  manual = batch["state"].copy()
  manual[:, -2:] = estimate
  expected = model.action_head.state_encoder(jnp.asarray(manual)[:, None, :], batch["embodiment_id"])
  np.testing.assert_allclose(fed, expected, rtol=1e-5, atol=1e-6)
  assert not np.allclose(fed, plain)
  # A state that reaches into the estimate's slots is refused at collate time with the fix.
  from ejax.models import groot_inputs
  collate = groot.make_collate(model.config)
  size = c.vision.image_size
  sample = {"observation.images.cam": np.zeros((size, size, 3), np.uint8), "task": "lift",
            "action": np.zeros((c.action_horizon, 2), np.float32)}
  assert collate([dict(sample, **{"observation.state": np.zeros(c.max_state_dim - 2, np.float32)})])["state"].shape
  with pytest.raises(ValueError, match=f"raise it to {c.max_state_dim + 2}"):
    collate([dict(sample, **{"observation.state": np.zeros(c.max_state_dim, np.float32)})])


def test_teacher_forcing_trains_the_head_on_the_target_and_acts_on_the_estimate():
  """aux_teacher_forcing: where a sample has a target the state slots hold it (noised only when a
  dropout rng is given); without one (inference) the estimate; the flow loss never trains the estimator."""
  c = tiny_config()
  c.update(aux_state_dim=2, aux_state_input=True, aux_teacher_forcing=True, tune_visual=True, tune_llm=True)
  c.vl_transformer.dropout = 0.0  # so that a dropout rng changes only the noise
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  batch["state"][:, -2:] = 0.0
  target = np.arange(8, dtype=np.float32).reshape(4, 2) / 8
  labelled = dict(batch, aux_state=target, aux_mask=np.array([1, 0, 1, 1], np.float32))
  vl, fed = model.context(labelled)
  estimate = np.asarray(model.action_head.aux_state(vl, labelled))
  manual = batch["state"].copy()
  manual[:, -2:] = np.where(labelled["aux_mask"][:, None] > 0, target, estimate)
  expected = model.action_head.state_encoder(jnp.asarray(manual)[:, None, :], batch["embodiment_id"])
  np.testing.assert_allclose(fed, expected, rtol=1e-5, atol=1e-6)
  _, noised = model.context(labelled, jax.random.key(4))
  assert not np.allclose(noised[0], fed[0]) and np.allclose(noised[1], fed[1], atol=1e-6)
  grads = nnx.grad(lambda m: m.compute_loss(labelled, jax.random.key(1), train=False)[1]["flow_loss"])(model)
  assert float(jnp.abs(grads.action_head.aux_state_out.kernel[...]).sum()) == 0
  assert float(jnp.abs(grads.action_head.state_encoder.layer1.W[...]).sum()) > 0


def test_heatmap_keypoints_feed_the_state_token_without_training_the_detectors_through_it():
  """aux_heatmap_input: the instruction's keypoints ((x, y) per point and camera) ride in the state's
  last slots, after the estimate's; the flow loss does not reach the detectors, the heatmap loss does."""
  c = tiny_config()
  c.update(aux_state_dim=2, aux_state_input=True, aux_teacher_forcing=True, aux_keypoints=2, aux_heatmaps=2,
           aux_heatmap_input=True, tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  batch["state"][:, -6:] = 0.0
  labels = np.random.default_rng(0).uniform(-1, 1, batch["aux_pixels"].shape).astype(np.float32)
  target = np.full((4, 2), 0.5, np.float32)   # teacher-forced into the estimate's slots
  labelled = dict(batch, aux_state=target, aux_mask=np.ones(4, np.float32), aux_pixels=labels)
  vl, fed = model.context(labelled)
  keypoints = np.asarray(model.heatmap_keypoints(labelled))
  assert keypoints.shape == (4, 4) and np.abs(keypoints).max() <= 1
  manual = batch["state"].copy()
  manual[:, -4:] = keypoints
  manual[:, -6:-4] = target
  expected = model.action_head.state_encoder(jnp.asarray(manual)[:, None, :], batch["embodiment_id"])
  np.testing.assert_allclose(fed, expected, rtol=1e-5, atol=1e-6)
  metrics = lambda m: m.compute_loss(labelled, jax.random.key(1), train=False)[1]
  flow = nnx.grad(lambda m: metrics(m)["flow_loss"])(model)
  heat = nnx.grad(lambda m: metrics(m)["aux_heatmap_loss"])(model)
  assert float(jnp.abs(flow.action_head.aux_queries.kernel[...]).sum()) == 0
  assert float(jnp.abs(heat.action_head.aux_queries.kernel[...]).sum()) > 0
  assert float(jnp.abs(flow.action_head.state_encoder.layer1.W[...]).sum()) > 0
  # compute_loss computes the heatmaps once and shares them: its heatmap and estimate losses are the
  # ones the separate calls (each computing its own heatmaps) give.
  computed = metrics(model)
  instruction = model.instruction_embedding(labelled)
  np.testing.assert_allclose(computed["aux_heatmap_loss"],
                             jnp.mean(model.action_head.heatmap_loss(labelled, instruction)), rtol=1e-5)
  estimate = model.aux_estimate(vl, labelled)
  np.testing.assert_allclose(computed["aux_state_loss"], jnp.mean(jnp.square(estimate - target)), rtol=1e-5)
  # The collate keeps both reservations free.
  collate = groot.make_collate(model.config)
  size = c.vision.image_size
  sample = {"observation.images.cam": np.zeros((size, size, 3), np.uint8), "task": "lift",
            "action": np.zeros((c.action_horizon, 2), np.float32), "observation.state": np.zeros(c.max_state_dim - 5, np.float32)}
  with pytest.raises(ValueError, match=f"raise it to {c.max_state_dim + 1}"):
    collate([sample])


def test_aux_image_size_gives_the_keypoints_larger_images_and_the_tower_a_pooled_copy():
  c = tiny_config()
  c.update(aux_state_dim=2, aux_keypoints=1, aux_heatmaps=1, aux_image_size=2 * c.vision.image_size)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 2, seed=3)
  assert batch["images"].shape[1:3] == (2 * c.vision.image_size,) * 2
  size = c.vision.image_size
  pooled = batch["images"].astype(np.float32).reshape(-1, size, 2, size, 2, 3).mean(axis=(2, 4))
  direct = model.backbone.connector(model.backbone.vision(normalize_images(jnp.asarray(pooled), jnp.float32)))
  np.testing.assert_allclose(model.backbone.encode_images(batch), direct, rtol=1e-4, atol=1e-5)
  # the keypoints read the full-size images: a 2x2 patch grid of the larger image
  logits = model.action_head.heatmap_logits(normalize_images(batch["images"], jnp.float32),
                                            model.instruction_embedding(batch))
  assert logits.shape[1] == size * size


def test_state_dims_hide_the_other_state_entries_from_the_action_head():
  c = tiny_config()
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  model.config.state_dims = (1,)
  _, kept = model.context(batch)
  changed = dict(batch, state=batch["state"] + np.eye(c.max_state_dim, dtype=np.float32)[0])  # entry 0 moves
  _, same = model.context(changed)
  np.testing.assert_array_equal(kept, same)
  _, moved = model.context(dict(batch, state=batch["state"] + np.eye(c.max_state_dim, dtype=np.float32)[1]))
  assert not np.allclose(moved, kept)


def test_heatmap_context_layers_and_position_term():
  """aux_heatmap_context_layers / _dilation: more residual 3x3 convolutions (dilated) before the
  instruction's detectors; aux_heatmap_position: logits + AUX_POSITION_SCALE * w . (x, y), w read
  from the instruction per camera and point (zero at initialisation), trained by the heatmap loss."""
  c = tiny_config()
  c.update(aux_state_dim=2, aux_keypoints=1, aux_heatmaps=2, aux_heatmap_context=True, aux_heatmap_context_layers=3,
           aux_heatmap_context_dilation=2)
  model = groot.create(c, nnx.Rngs(0))
  assert model.action_head.heatmap_context_more.shape == (2, 3, 3, 32, 32)
  assert model.action_head.aux_query_position is None
  batch = groot.example_batch(c, 2, seed=3)
  images = normalize_images(batch["images"], jnp.float32)
  instruction = model.instruction_embedding(batch)
  base = model.action_head.heatmap_logits(images, instruction)
  # The extra layers see beyond a 3x3 neighbourhood: with the later ones dilated by 2, a change 4
  # cells away moves a cell's logits (one layer of 3x3 reaches 1 cell).
  size = c.vision.image_size
  moved = np.array(batch["images"])
  moved[:, :2, 8:10] = 255 - moved[:, :2, 8:10]          # cell (0, 4) of the 2x2-patch grid
  changed = model.action_head.heatmap_logits(normalize_images(jnp.asarray(moved), jnp.float32), instruction)
  grid = size // 2
  delta = np.abs(np.asarray(changed - base)).reshape(2, grid, grid, -1).max(axis=(0, 3))
  # Reach 1 + 2 + 2 = 5 cells: 4 away moves, 6 away does not beyond float rounding (exactly 0 on
  # jax 0.9.2; jax 0.11's CPU convolutions leave ~1e-6 on logits of ~10 everywhere).
  noise = 1e-6 * float(jnp.abs(base).max())
  assert delta[0, 0] > 1e3 * noise and delta[0, 10] < noise

  c.update(aux_heatmap_position=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  head = model.action_head
  weights = head.heatmap_position_weights(instruction)
  assert weights.shape == (2 * c.num_cameras, 2, 2)
  with_position = head.heatmap_logits(images, instruction)
  head.aux_query_position = nnx.data(None)
  without = head.heatmap_logits(images, instruction)
  cells = jnp.asarray(groot.pixel_grid(grid, grid))
  expected = without + groot.AUX_POSITION_SCALE * jnp.einsum("pd,nqd->npq", cells, weights)
  np.testing.assert_allclose(with_position, expected, rtol=1e-5, atol=1e-4)
  # model.aux_heatmap_position_scale sets the term's gain
  c.update(aux_heatmap_position_scale=40.0)
  scaled = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1).action_head
  np.testing.assert_allclose(scaled.heatmap_logits(images, instruction),
                             without + 40.0 * jnp.einsum("pd,nqd->npq", cells, weights), rtol=1e-5, atol=1e-4)
  # zero-initialised: a fresh model's detectors start without a position preference, and the
  # heatmap loss trains the weights
  fresh = groot.create(c, nnx.Rngs(0))
  assert float(jnp.abs(fresh.action_head.heatmap_position_weights(instruction)).max()) == 0
  labelled = dict(batch, aux_state=np.zeros((2, 2), np.float32), aux_mask=np.ones(2, np.float32),
                  aux_pixels=np.random.default_rng(0).uniform(-1, 1, batch["aux_pixels"].shape).astype(np.float32))
  grads = nnx.grad(lambda m: m.compute_loss(labelled, jax.random.key(1), train=False)[1]["aux_heatmap_loss"])(fresh)
  assert float(jnp.abs(grads.action_head.aux_query_position.kernel[...]).sum()) > 0


def test_estimate_can_leave_the_detectors_and_the_gripper_alone():
  """aux_estimate_trains_heatmaps=False: the estimate's loss does not reach the instruction's
  detectors (their own heatmap loss still does), and the estimate is unchanged in value;
  aux_proprio_dims: the readout ignores the state entries left out (ejax.sim's gripper, index 7)."""
  c = tiny_config()
  c.update(aux_state_dim=2, aux_keypoints=1, aux_heatmaps=2, aux_heatmap_context=True, tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  labelled = dict(batch, aux_state=np.full((4, 2), 0.5, np.float32), aux_mask=np.ones(4, np.float32),
                  aux_pixels=np.random.default_rng(0).uniform(-1, 1, batch["aux_pixels"].shape).astype(np.float32))
  metrics = lambda m: m.compute_loss(labelled, jax.random.key(1), train=False)[1]
  estimate_grad = lambda m: nnx.grad(lambda m: metrics(m)["aux_state_loss"])(m).action_head
  trained = estimate_grad(model)
  assert float(jnp.abs(trained.aux_queries.kernel[...]).sum()) > 0
  assert float(jnp.abs(trained.heatmap_context[...]).sum()) > 0
  before = metrics(model)
  model.config.aux_estimate_trains_heatmaps = False
  after = metrics(model)
  np.testing.assert_allclose(after["aux_state_loss"], before["aux_state_loss"], rtol=1e-6)
  left = estimate_grad(model)
  assert float(jnp.abs(left.aux_queries.kernel[...]).sum()) == 0
  assert float(jnp.abs(left.heatmap_context[...]).sum()) == 0
  assert float(jnp.abs(left.aux_state_out.kernel[...]).sum()) > 0
  heat = nnx.grad(lambda m: metrics(m)["aux_heatmap_loss"])(model).action_head
  assert float(jnp.abs(heat.aux_queries.kernel[...]).sum()) > 0

  vl, _ = model.context(batch)
  model.config.aux_proprio_dims = tuple(i for i in range(c.max_state_dim) if i != 1)
  kept = model.aux_estimate(vl, batch)
  moved = lambda i: model.aux_estimate(vl, dict(batch, state=batch["state"] + np.eye(c.max_state_dim, dtype=np.float32)[i]))
  np.testing.assert_array_equal(moved(1), kept)
  assert not np.allclose(moved(0), kept)


def test_the_estimate_places_its_points_on_the_calibrated_cameras_rays():
  """model.aux_geometry_cameras with the policy's statistics (aux_geometry_norm): each instruction
  point's estimated position lies on the camera ray through its keypoint, at the readout's height;
  the readout's other entries stay. Without the statistics (training) the readout stands."""
  from ejax.sim import camera, scene
  c = tiny_config()
  c.update(aux_state_dim=7, aux_keypoints=1, aux_heatmaps=2, aux_heatmap_context=True, aux_state_input=True,
           tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 4, seed=3)
  vl, _ = model.context(batch)
  readout, plain = model.aux_estimate(vl, batch), model.context_inputs(batch)[1]
  agentview = scene.camera_calibration()["agentview"]
  model.config.update(aux_geometry_cameras={"agentview": agentview}, aux_geometry_radius=(0, 0))
  np.testing.assert_array_equal(model.context_inputs(batch)[1], plain)
  centre, scale = np.linspace(-0.2, 0.3, 7), np.linspace(0.05, 0.3, 7)
  model.config.aux_geometry_norm = {"state": [[0.0] * c.max_state_dim, [1.0] * c.max_state_dim],
                                    "estimate": [centre.tolist(), scale.tolist()]}
  placed = np.asarray(model.geometric_estimate(batch, readout))
  keypoints = np.asarray(model.heatmap_keypoints(batch)).reshape(4, 2, 2)
  metres, before = placed * scale + centre, np.asarray(readout) * scale + centre
  rotation = np.asarray(agentview["rotation"], np.float32).reshape(3, 3)
  for k, start in enumerate((0, 3)):
    seen = camera.image_points(metres[:, start:start + 3], np.asarray(agentview["position"]), rotation, 64, 64,
                               agentview["fovy"], xp=np)
    np.testing.assert_allclose(seen, keypoints[:, k], atol=1e-4)
    np.testing.assert_allclose(metres[:, start + 2], before[:, start + 2], atol=1e-5)
  np.testing.assert_allclose(placed[:, 6], np.asarray(readout)[:, 6], atol=1e-6)
  assert not np.allclose(placed[:, :2], np.asarray(readout)[:, :2])



def test_the_relation_picks_the_peak_the_estimate_is_placed_on():
  """model.aux_geometry_relation_margin: the world camera's keypoint of a point with a radius is the
  soft-argmax around the detection the instruction's position term prefers (geometry.relational_peak),
  not around the logits' argmax; 0 keeps the argmax."""
  from ejax.models import geometry
  from ejax.models.connector import pixel_grid
  from ejax.sim import camera, scene
  c = tiny_config()
  c.update(aux_state_dim=7, aux_keypoints=1, aux_heatmaps=2, aux_heatmap_context=True, aux_state_input=True,
           aux_heatmap_position=True, tune_visual=True, tune_llm=True)
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 8, seed=3)
  vl, _ = model.context(batch)
  readout = model.aux_estimate(vl, batch)
  agentview = scene.camera_calibration()["agentview"]
  model.config.update(aux_geometry_cameras={"agentview": agentview}, aux_geometry_radius=(1, 1))
  model.config.aux_geometry_norm = {"state": [[0.0] * c.max_state_dim, [1.0] * c.max_state_dim],
                                    "estimate": [[0.0] * 7, [1.0] * 7]}
  head = model.action_head
  images = groot.normalize_images(batch["images"], head.dtype)
  instruction = model.instruction_embedding(batch)
  logits = head.heatmap_logits(images, instruction)
  grid_shape = tuple(s // head.aux_keypoints.pixel_patch for s in images.shape[1:3])
  grid = pixel_grid(*grid_shape)
  position = head.heatmap_position_scale * jnp.einsum("pd,nqd->npq", jnp.asarray(grid),
                                                      head.heatmap_position_weights(instruction))
  rotation = np.asarray(agentview["rotation"], np.float32).reshape(3, 3)

  def keypoints(margin):
    model.config.aux_geometry_relation_margin = margin
    metres = np.asarray(model.geometric_estimate(batch, readout))
    return np.stack([camera.image_points(metres[:, s:s + 3], np.asarray(agentview["position"]), rotation, 64, 64,
                                         agentview["fovy"], xp=np) for s in (0, 3)], 1)

  def around(centre):
    return np.asarray(geometry.local_soft_argmax(logits, grid, 1, 2.0 / grid_shape[1], centre=centre))

  def agree(seen, expected):  # where the readout's random height puts the point in front of the camera
    ahead = np.all(np.abs(seen) <= 1.0, -1)
    assert ahead.mean() > 0.5
    np.testing.assert_allclose(seen[ahead], expected[ahead], atol=1e-4)

  chosen = geometry.relational_peak(logits - position, position, grid_shape, 1e9)
  agree(keypoints(1e9), around(chosen))
  agree(keypoints(0.0), around(jnp.argmax(logits, axis=1)))
  assert np.any(np.asarray(chosen) != np.asarray(jnp.argmax(logits, axis=1)))
