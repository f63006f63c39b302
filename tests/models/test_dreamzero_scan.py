"""DreamZero's repeated blocks as one lax.scan (model.scan_layers, ejax.models.layers.run_blocks): the
Wan DiT's teacher-forced blocks, umT5's and CLIP's compute what the block-by-block loop does, loss and
gradients included, with the parameter layout unchanged (issue 32, deliverable 6: the full-depth 5B step
compiles one block per stack instead of 30 + 24 + 31)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import layers
from ejax.models.dreamzero import model as dz


@pytest.mark.slow  # CI time (47 s): run_blocks' scan-vs-loop test on GR00T's DiT runs in CI
def test_scanned_dreamzero_matches_the_unrolled_loop_in_loss_and_gradients():
  config = dz.model_config("runlocal")
  config.remat = "full"                          # the 5B's: remat inside the scanned block
  # 4 blocks a stack: run_blocks scans from layers.MIN_SCANNED repeats (fewer run as a loop)
  config.dit.num_layers = 4
  config.text.num_layers = 4
  config.image.update(num_layers=5, use_layers=4)  # CLIP: only the first use_layers blocks run
  model = layers.host_random_init(nnx.eval_shape(lambda: dz.create(config, nnx.Rngs(0))), 0, stddev=0.2)
  batch = {k: jnp.asarray(v) for k, v in dz.example_batch(config, 2, seed=1).items()}
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def modules(m):
    return m.dit, m.text_encoder, m.image_encoder

  def loss_fn(params, scan):
    m = nnx.merge(graphdef, params, rest)
    for module in modules(m):
      module.scan_layers = scan
    loss, metrics = m.compute_loss(batch, jax.random.key(3))
    return loss, (metrics, m.text_encoder(batch["text_ids"], batch["text_mask"]), m.image_encoder(batch["first_frame"]))

  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=1)
  (loss_loop, (metrics_loop, text_loop, image_loop)), grads_loop = grad(params, False)
  (loss_scan, (metrics_scan, text_scan, image_scan)), grads_scan = grad(params, True)
  assert np.isfinite(float(loss_loop))
  np.testing.assert_allclose(loss_scan, loss_loop, rtol=1e-5)
  np.testing.assert_allclose(metrics_scan["action_loss"], metrics_loop["action_loss"], rtol=1e-5)
  np.testing.assert_allclose(text_scan, text_loop, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(image_scan, image_loop, rtol=1e-5, atol=1e-5)
  flat_loop, flat_scan = dict(nnx.to_flat_state(grads_loop)), dict(nnx.to_flat_state(grads_scan))
  assert flat_loop.keys() == flat_scan.keys()    # the per-layer parameter layout is the same
  for path in (("dit", "blocks", 0, "self_attn", "q", "kernel"), ("dit", "blocks", 3, "ffn", "fc2", "kernel"),
               ("dit", "blocks", 1, "modulation"), ("dit", "patch_embedding", "kernel")):
    g_loop, g_scan = flat_loop[path][...], flat_scan[path][...]
    scale = float(jnp.abs(g_loop).max())
    assert scale > 0
    np.testing.assert_allclose(g_scan, g_loop, rtol=1e-4, atol=1e-4 * scale)   # float32 summation order

  # Scanned, each stack traces one block: the DiT (4 blocks), umT5 (4) and CLIP's first 4 of 5.
  def jaxpr(scan):
    m = nnx.merge(graphdef, params, rest)
    for module in modules(m):
      module.scan_layers = scan
    return str(jax.make_jaxpr(lambda b: m.compute_loss(b, jax.random.key(3))[0])(batch))

  scanned = jaxpr(True)
  assert scanned.count("scan[") == 3 and scanned.count("length=4") == 3
  assert "scan[" not in jaxpr(False)
