"""DreamZero (issue 32): published sizes from shapes alone, the flow-matching recipe, the WAM mask's
causality through the whole DiT, and the VAE's shapes, at runlocal size on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import dreamzero as dreamzero_config
from ejax.models import layers, summary
from ejax.models.dreamzero import model as dz
from ejax.models.dreamzero import sequence, unipc
from ejax.models.dreamzero.vae import WanVAE, WanVAEConfig


def _counts(variant: str) -> dict:
  config = dreamzero_config.get_config(variant)
  return summary.summarize(config.model, {"data": 1, "fsdp": 8, "tensor": 1},
                           [tuple(rule) for rule in config.sharding_rules])


@pytest.mark.parametrize("variant,dit,dit_with_encoders,vae", [
    ("5b", 5.57e9, 5.6e9, 3.54e8),    # Wan2.2-TI2V-5B: ~5.6B with the action/state encoders and decoder; the VAE
    #                                   shape-correct only (not the released 2.2 VAE's count)
    ("14b", 16.39e9, 16.5e9, 1.27e8),  # Wan2.1-I2V-14B: ~16.5B; Wan2.1 VAE 127M as released
])
def test_summary_counts_match_the_published_components(variant, dit, dit_with_encoders, vae):
  result = _counts(variant)
  counts = result["param_counts"]
  assert counts["dit"] == pytest.approx(dit, rel=0.01)
  assert counts["dit"] + counts["per_embodiment"] == pytest.approx(dit_with_encoders, rel=0.01)
  assert counts["text_encoder"] == pytest.approx(5.68e9, rel=0.01)      # umT5-XXL encoder, 5.7B
  assert counts["image_encoder"] == pytest.approx(0.632e9, rel=0.01)    # CLIP ViT-H/14 vision, ~0.63B
  assert counts["vae"] == pytest.approx(vae, rel=0.01)
  assert result["trainable_params"] == counts["dit"] + counts["per_embodiment"]
  # FSDP over 8 devices: no parameter of the DiT or the encoders is left whole on every device, and
  # each device holds an eighth of the parameters (the VAE's convolutions included).
  assert result["largest_replicated_param"]["bytes"] < 64 * 2**20
  assert result["total_param_bytes_per_device"] < 4 * result["total_params"] / 8 * 1.01


def test_sample_layout_of_the_published_sizes():
  assert dz.layout(dz.model_config("5b")).length == 1000  # 450 + 450 + 96 + 4
  assert dz.layout(dz.model_config("14b")).frame_tokens == 880


def test_flow_matching_grid_and_weights():
  sigmas = dz.shifted_sigmas()
  assert sigmas.shape == (1000,) and sigmas[0] == 1.0 and np.all(np.diff(sigmas) < 0)
  # shift 5: sigma 0.5 on the unshifted grid becomes 5 * 0.5 / (1 + 4 * 0.5)
  assert sigmas[500] == pytest.approx(2.5 / 3.0)
  weights = dz.training_weights()
  assert weights.mean() == pytest.approx(1.0) and weights.min() == 0.0
  # the bell peaks where the shifted timestep is near 500
  assert abs(sigmas[int(np.argmax(weights))] * 1000 - 500) < 5


@pytest.fixture(scope="module")
def runlocal():
  config = dz.model_config("runlocal")
  # Host-drawn weights (layers.host_random_init): an eager init of every parameter takes ~40 s on CPU.
  model = layers.host_random_init(nnx.eval_shape(lambda: dz.create(config, nnx.Rngs(0))), 0, stddev=0.2)
  batch = {k: jnp.asarray(v) for k, v in dz.example_batch(config, 2, seed=1).items()}
  return config, model, batch


@pytest.fixture(scope="module")
def teacher_forced(runlocal):
  """The teacher-forced DiT outputs, jitted once for the tests below, and the frozen encoders' outputs."""
  _, model, batch = runlocal
  text = model.text_encoder(batch["text_ids"], batch["text_mask"])
  image = model.image_encoder(batch["first_frame"])
  return jax.jit(model._velocity), text, image


@pytest.mark.slow  # ~45 s of compilation; test_dreamzero_train.py trains the same loss in CI
def test_loss_is_the_sum_of_video_and_action_terms_and_trains_only_the_dit(runlocal):
  config, model, batch = runlocal
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params):
    loss, metrics = nnx.merge(graphdef, params, rest).compute_loss(batch, jax.random.key(3))
    return loss, metrics

  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert np.isfinite(float(loss)) and metrics["per_sample_loss"].shape == (2,)
  np.testing.assert_allclose(loss, metrics["video_loss"] + metrics["action_loss"], rtol=1e-5)
  norms = {path: float(jnp.linalg.norm(g)) for path, g in nnx.to_flat_state(grads)}
  trained = [v for p, v in norms.items() if p[0] == "dit"]
  frozen = [v for p, v in norms.items() if p[0] != "dit"]
  assert min(trained[:3]) > 0 and np.mean(np.asarray(trained) > 0) > 0.9
  assert max(frozen) == 0.0  # umT5, CLIP and the VAE sit behind stop_gradient


@pytest.mark.slow  # ~20 s; implied in CI by test_chunk_by_chunk_kv_cache_matches_teacher_forcing (the chunk
#                   path never sees later tokens) and the mask tests in tests/kernels/test_attention_wam.py
def test_first_chunk_does_not_see_later_chunks_or_later_clean_frames(runlocal, teacher_forced):
  """The WAM mask through the whole DiT: chunk 0's video and action outputs depend on the first clean
  frame, its own noisy latents and actions, but not on clean frames of chunk 0 onwards or on chunk 1."""
  config, model, batch = runlocal
  lay = model.layout
  latents = batch["latents"]
  b = latents.shape[0]
  rng = np.random.default_rng(0)
  noisy = jnp.asarray(rng.normal(size=latents.shape), jnp.float32)
  actions = jnp.asarray(rng.normal(size=batch["actions"].shape), jnp.float32)
  t = jnp.full((b, lay.latent_frames), 500.0)
  at = jnp.full((b, lay.num_actions), 500.0)
  velocity, text, image = teacher_forced
  run = lambda clean, noisy, actions: velocity(clean, noisy, actions, t, at, batch, text, image)
  video, action = run(latents, noisy, actions)
  chunk0_video = slice(lay.frame_tokens, lay.frame_tokens + lay.frames_per_chunk * lay.frame_tokens)
  chunk0_actions = slice(0, lay.actions_per_chunk)
  later_clean = latents.at[:, 1:].add(3.0)            # every clean frame after the first
  later_noisy = noisy.at[:, 1 + lay.frames_per_chunk:].add(3.0)
  later_actions = actions.at[:, lay.actions_per_chunk:].add(3.0)
  for changed in ((later_clean, noisy, actions), (latents, later_noisy, later_actions)):
    v2, a2 = run(*changed)
    np.testing.assert_allclose(v2[:, chunk0_video], video[:, chunk0_video], atol=1e-5)
    np.testing.assert_allclose(a2[:, chunk0_actions], action[:, chunk0_actions], atol=1e-5)
  # ...while the first clean frame and chunk 0's own actions do change them.
  v3, a3 = run(latents.at[:, 0].add(3.0), noisy, actions)
  assert float(jnp.abs(v3[:, chunk0_video] - video[:, chunk0_video]).max()) > 1e-3
  v4, a4 = run(latents, noisy, actions.at[:, 0].add(3.0))
  assert float(jnp.abs(a4[:, chunk0_actions] - action[:, chunk0_actions]).max()) > 1e-3


def test_rope_angles_are_3d_for_video_and_1d_for_actions():
  lay = sequence.Layout(grid_height=2, grid_width=3, num_chunks=1, frames_per_chunk=1, actions_per_chunk=2,
                        states_per_chunk=1)
  angles = sequence.rope_angles(lay, head_dim=12)  # time 4 channels (2 pairs), height 4, width 4
  assert angles.shape == (lay.length, 6)
  video = angles[:lay.video_tokens].reshape(2, 2, 3, 6)
  np.testing.assert_array_equal(video[1, :, :, :2], np.broadcast_to(video[1, 0, 0, :2], (2, 3, 2)))
  np.testing.assert_array_equal(video[:, :, 2, 4:], np.broadcast_to(video[0, 0, 2, 4:], (2, 2, 2)))
  np.testing.assert_array_equal(angles[lay.video_tokens:2 * lay.video_tokens], angles[:lay.video_tokens])
  actions = angles[2 * lay.video_tokens:2 * lay.video_tokens + 2]
  np.testing.assert_allclose(actions[1], 1.0 / 10000 ** (np.arange(0, 12, 2) / 12), rtol=1e-6)


def test_vae_strides_and_the_error_for_a_clip_it_cannot_take():
  config = WanVAEConfig.for_version("2.1", dim=4, z_dim=3, dim_mult=(1, 2, 2, 2))
  vae = layers.host_random_init(nnx.eval_shape(lambda: WanVAE(config, rngs=nnx.Rngs(0))), 0, stddev=0.2)
  video = jnp.zeros((1, 9, 16, 24, 3))
  latents = jax.eval_shape(vae.encode, video)
  assert latents.shape == (1, 3, 2, 3, 3)
  assert jax.eval_shape(vae.decode, latents).shape == video.shape
  assert WanVAEConfig.for_version("2.2").spatial_stride == 16 and WanVAEConfig.for_version("2.2").z_dim == 48
  with pytest.raises(ValueError, match="error: the Wan VAE takes 1 \\+ 4k frames"):
    vae.encode(jnp.zeros((1, 8, 16, 24, 3)))


@pytest.mark.parametrize("shape, kernel, stride", [((2, 9, 10, 12, 5), (3, 3, 3, 5, 7), (1, 1, 1)),
                                                    ((2, 7, 6, 6, 4), (3, 1, 1, 4, 8), (2, 1, 1)),
                                                    ((1, 5, 8, 8, 3), (3, 3, 3, 3, 4), (1, 2, 2))])
def test_time_folded_conv_is_the_3d_conv(shape, kernel, stride):
  """The VAE's CPU path (time taps folded into a 2D conv's channels) computes XLA's Conv3d."""
  from ejax.models.dreamzero.vae import _time_folded_conv
  rng = np.random.default_rng(0)
  x, k = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape, kernel))
  expected = jax.lax.conv_general_dilated(x, k, stride, "VALID", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
  np.testing.assert_allclose(_time_folded_conv(x, k, stride), expected, atol=1e-4)


def test_chunk_by_chunk_kv_cache_matches_teacher_forcing(runlocal, teacher_forced):
  """Inference's chunk step (the clean frames before the chunk as a KV cache, then the chunk's noisy
  video, actions and states alone) gives the teacher-forced pass's outputs for that chunk."""
  config, model, batch = runlocal
  lay = model.layout
  rng = np.random.default_rng(1)
  latents = batch["latents"]
  noisy = jnp.asarray(rng.normal(size=latents.shape), jnp.float32)
  actions = jnp.asarray(rng.normal(size=batch["actions"].shape), jnp.float32)
  video_t = jnp.asarray(rng.uniform(0, 1000, (latents.shape[0], lay.latent_frames)), jnp.float32)
  action_t = jnp.repeat(video_t[:, 1::lay.frames_per_chunk], lay.actions_per_chunk, axis=1)
  velocity, text, image = teacher_forced
  args = (latents, noisy, actions, video_t, action_t, batch, text, image)
  video, action = velocity(*args)
  chunk = lay.num_chunks - 1  # the last chunk: a context of the first frame and every earlier chunk
  chunk_video, chunk_action = jax.jit(lambda *a: model.chunk_velocity(*a, chunk))(*args)
  where = sequence.chunk_indices(lay, chunk)
  assert where["context"].size == lay.frame_tokens * (1 + chunk * lay.frames_per_chunk)
  np.testing.assert_allclose(chunk_video, video[:, where["video"] - lay.video_tokens], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(chunk_action, action[:, where["actions"] - 2 * lay.video_tokens], rtol=1e-4, atol=1e-4)


def test_unpatchify_inverts_the_head_layout():
  latents = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 6, 5)), jnp.float32)
  tokens = dz.patchify(latents, (1, 2, 2), channels_last=True)
  np.testing.assert_array_equal(dz.unpatchify(tokens, (1, 2, 2), (3, 4, 6)), latents)


@pytest.mark.slow  # ~50 s of compilation: two KV caches and a guided chunk step
def test_sample_chunk_shapes_guidance_and_determinism(runlocal):
  """The policy step: the chunk's actions and latents, finite and deterministic for a key; guidance
  changes the video (one Euler step: the actions take the conditional velocity, as the official
  policy's do, so the guidance scale leaves them alone)."""
  config, model, batch = runlocal
  lay = model.layout
  run = jax.jit(lambda scale: model.sample_chunk(batch, jax.random.key(0), chunk=1, num_steps=1, cfg_scale=scale))
  actions, video = run(5.0)
  assert actions.shape == (2, lay.actions_per_chunk, config.action_dim)
  assert video.shape == (2, lay.frames_per_chunk) + batch["latents"].shape[2:]
  assert np.all(np.isfinite(actions)) and np.all(np.isfinite(video))
  actions_again, video_again = run(5.0)
  np.testing.assert_array_equal(actions, actions_again)
  actions_unguided, video_unguided = run(1.0)
  assert float(jnp.abs(video - video_unguided).max()) > 1e-4
  np.testing.assert_allclose(actions_unguided, actions, rtol=1e-5, atol=1e-6)


def test_unipc_follows_the_flow_of_gaussian_data_better_than_euler():
  """Data N(mu, s^2): the exact flow ODE maps a noise draw n to mu + s n and its velocity is known in
  closed form. 16 UniPC steps on the official grid land far closer than 16 Euler steps."""
  mu, s = 0.5, 1.0
  n = np.random.default_rng(0).standard_normal(1000)

  def velocity(x, sigma):
    alpha = 1 - sigma
    mean = mu + alpha * s**2 / (alpha**2 * s**2 + sigma**2) * (x - alpha * mu)
    return (x - mean) / sigma

  grid = unipc.sigmas(16)
  assert grid[0] == pytest.approx(5 * 0.999 / (1 + 4 * 0.999)) and grid[-1] == 0.0 and grid.shape == (17,)
  start = (1 - grid[0]) * mu + np.sqrt((1 - grid[0]) ** 2 * s**2 + grid[0] ** 2) * n
  solver, x, y = unipc.UniPC(16), start, start
  for i in range(16):
    assert solver.timestep == int(grid[i] * 1000)
    x = solver.step(velocity(x, grid[i]), x)
    y = y + (grid[i + 1] - grid[i]) * velocity(y, grid[i])
  unipc_error, euler_error = np.abs(x - (mu + s * n)).max(), np.abs(y - (mu + s * n)).max()
  assert unipc_error < 0.15 and unipc_error < 0.3 * euler_error, (unipc_error, euler_error)
