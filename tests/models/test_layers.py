"""Shared layers and the SigLIP encoder: numerics, RoPE, packed attention, axis names."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ejax.models import layers, siglip
from ejax.parallel.params import variable_axis_names


def test_norms_match_numpy():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8)) * 3 + 1
  ln = layers.LayerNorm(8, eps=1e-5, rngs=nnx.Rngs(0))
  xn = np.asarray(x)
  expected = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-5)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(ln, x), expected, atol=1e-5)
  rms = layers.RMSNorm(8, eps=1e-6, zero_centered=True, rngs=nnx.Rngs(0))
  rms.scale[...] = jnp.full((8,), 0.5)
  expected = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * 1.5
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(rms, x), expected, atol=1e-5)


def test_norm_gradients_are_the_plain_formula_through_a_residual_stack():
  """materialize_cotangent changes how XLA schedules a norm's backward, never its value: gradients
  through a residual stack of LayerNorm / RMSNorm match the same stack written without it."""
  x = jax.random.normal(jax.random.key(1), (2, 5, 8)) * 2 + 0.5
  w = jax.random.normal(jax.random.key(2), (3, 8, 8)) * 0.3
  ln = layers.LayerNorm(8, rngs=nnx.Rngs(0))
  rms = layers.RMSNorm(8, rngs=nnx.Rngs(0))

  def plain_ln(h):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

  def plain_rms(h):
    return h * jax.lax.rsqrt((h ** 2).mean(-1, keepdims=True) + 1e-6)

  def stack(norm, x, w):
    h = x
    for layer in range(3):
      h = h + jnp.tanh(norm(h) @ w[layer])
    return jnp.sum(h ** 2)

  for module, plain in ((ln, plain_ln), (rms, plain_rms)):
    got = jax.jit(jax.grad(lambda x, w: stack(module, x, w), argnums=(0, 1)))(x, w)
    want = jax.grad(lambda x, w: stack(plain, x, w), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(got[0]).max()) > 0  # a real gradient flowed


def test_rope_scores_depend_only_on_relative_position():
  q = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))

  @jax.jit
  def score_fn(m, n):
    qm = layers.apply_rope(q, m[None, None], theta=10000.0)
    kn = layers.apply_rope(k, n[None, None], theta=10000.0)
    return jnp.sum(qm * kn)

  score = lambda m, n: float(score_fn(jnp.int32(m), jnp.int32(n)))

  np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-4)
  assert abs(score(5, 2) - score(5, 4)) > 1e-3
  np.testing.assert_allclose(layers.apply_rope(q, jnp.zeros((1, 1)), theta=1e4), q)


def test_rope_rotates_halves_and_pairs_as_written_with_no_concatenate():
  """Rotate-half (Qwen, Gemma) and interleaved pairs (Wan) against the formulas; rotate-half lowered
  without a concatenate, so that XLA fuses the rotation with the QK-norm before it (layers.apply_rope).
  Wan's pairs keep their stack: the flip's order of operations moved fp32 DreamZero values by an ulp
  (CPU recipes train in fp32), and its CPU figures were measured with the stack."""
  from ejax.models.dreamzero.wan_dit import apply_rope_pairs

  x = jax.random.normal(jax.random.key(3), (2, 5, 3, 8))
  positions = jnp.arange(10).reshape(2, 5) * 3
  angles = positions[..., None].astype(jnp.float32) / (1e4 ** (jnp.arange(4) * 2.0 / 8))
  cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
  x1, x2 = x[..., :4], x[..., 4:]
  np.testing.assert_allclose(layers.apply_rope(x, positions, theta=1e4),
                             np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1), rtol=1e-6, atol=1e-6)
  even, odd = x[0, ..., 0::2], x[0, ..., 1::2]  # Wan's pairs, one sample's angles [len, half]
  want = np.stack([even * cos[0] - odd * sin[0], even * sin[0] + odd * cos[0]], -1).reshape(x[0].shape)
  np.testing.assert_allclose(apply_rope_pairs(x[:1], angles[0])[0], want, rtol=1e-6, atol=1e-6)
  assert "concatenate" not in jax.jit(layers.apply_rope, static_argnames="theta").lower(x, positions, theta=1e4).as_text()


def test_attention_packed_rows_equal_separate_samples():
  attn = layers.host_random_init(nnx.eval_shape(lambda: layers.Attention(
      16, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e4, rngs=nnx.Rngs(0))), stddev=0.3)
  a = jax.random.normal(jax.random.key(3), (1, 3, 16))
  b = jax.random.normal(jax.random.key(4), (1, 4, 16))
  packed = jnp.concatenate([a, b, jnp.zeros((1, 1, 16))], axis=1)
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
  run = nnx.jit(lambda m, x, s, p: m(x, mask_kind="causal", q_segment_ids=s, q_positions=p))
  out = run(attn, packed, segment_ids, positions)
  out_a = run(attn, a, jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None])
  out_b = run(attn, b, jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None])
  np.testing.assert_allclose(out[:, :3], out_a, atol=1e-5)
  np.testing.assert_allclose(out[:, 3:7], out_b, atol=1e-5)


def test_siglip_shapes_and_every_parameter_has_axis_names():
  config = siglip.SiglipConfig(width=32, depth=2, mlp_dim=64, num_heads=4, patch_size=4, image_size=16)
  model = layers.host_random_init(nnx.eval_shape(lambda: siglip.SiglipVisionTransformer(config, rngs=nnx.Rngs(0))))
  images = siglip.normalize_images(jnp.full((2, 16, 16, 3), 255, jnp.uint8))
  assert float(images.max()) == 1.0
  assert nnx.jit(lambda m, x: m(x))(model, images).shape == (2, 16, 32)
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = variable_axis_names(variable)
    assert names is not None and len(names) == variable.get_value().ndim, path
  # patchify keeps each patch's pixels together, row-major over patches.
  image = jnp.arange(2 * 8 * 8 * 1, dtype=jnp.float32).reshape(2, 8, 8, 1)
  patches = siglip.patchify(image, 4)
  np.testing.assert_array_equal(patches[0, 1], np.asarray(image[0, :4, 4:8, 0]).reshape(-1))


def test_run_block_remat_keeps_values_and_gradients():
  config = siglip.SiglipConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4, image_size=8)
  block = layers.host_random_init(nnx.eval_shape(lambda: siglip.SiglipBlock(
      config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))), stddev=0.2)
  x = jax.random.normal(jax.random.key(5), (2, 4, 16))

  def loss(b, x, remat):
    return jnp.sum(layers.run_block(b, x, remat=remat) ** 2)

  grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)), static_argnums=2)
  (gb_none, gx_none), (gb_full, gx_full) = grad(block, x, "none"), grad(block, x, "full")
  np.testing.assert_allclose(gx_full, gx_none, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gb_full.mlp.fc1.kernel[...], gb_none.mlp.fc1.kernel[...], rtol=1e-5, atol=1e-6)
  jaxpr = str(jax.make_jaxpr(lambda x: layers.run_block(block, x, remat="full"))(x))
  assert "checkpoint" in jaxpr or "remat" in jaxpr
  assert "checkpoint" not in str(jax.make_jaxpr(lambda x: layers.run_block(block, x))(x))


def test_scanned_blocks_match_the_unrolled_loop_in_values_and_gradients():
  """run_blocks' lax.scan (GR00T's DiT: alternating cross- and self-attention blocks, scanned in
  pairs, dropout on, remat full) computes what the block-by-block loop does, gradients included,
  and compiles one block per kind instead of every block."""
  from ejax.models import dit

  config = dit.DiTConfig(num_layers=8, num_heads=2, head_dim=8, output_dim=8, dropout=0.1, cross_attention_dim=12)
  model = layers.host_random_init(nnx.eval_shape(lambda: dit.DiT(config, remat="full", rngs=nnx.Rngs(0))),
                                  stddev=0.2)
  x = jax.random.normal(jax.random.key(1), (3, 5, config.width))
  vl = jax.random.normal(jax.random.key(2), (2, 7, 12))
  inputs = dict(vl_tokens=vl, vl_segment_ids=jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 0]]),
                sample_row=jnp.array([0, 0, 1]), sample_segment=jnp.array([1, 2, 1]), rng=jax.random.key(3))
  timesteps = jnp.array([3, 500, 999])

  def loss(m, x, scan):
    m.scan_layers = scan
    return jnp.sum(m(x, timesteps, **inputs) ** 2)

  grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
  (v_loop, (gm_loop, gx_loop)), (v_scan, (gm_scan, gx_scan)) = grad(model, x, False), grad(model, x, True)
  np.testing.assert_allclose(v_scan, v_loop, rtol=1e-5)
  np.testing.assert_allclose(gx_scan, gx_loop, rtol=1e-4, atol=1e-5)
  for i in (0, 3, 7):   # cross, self and the last block's weights
    np.testing.assert_allclose(gm_scan.blocks[i].attn1.q_proj.kernel[...], gm_loop.blocks[i].attn1.q_proj.kernel[...],
                               rtol=1e-4, atol=1e-5)
  model.scan_layers = True
  jaxpr = str(jax.make_jaxpr(lambda x: model(x, timesteps, **inputs))(x))
  assert jaxpr.count("scan[") == 1 and "length=4" in jaxpr
  # Fewer repeats than layers.MIN_SCANNED (CPU sizes) stay a loop.
  small = layers.host_random_init(nnx.eval_shape(lambda: dit.DiT(dit.DiTConfig(
      num_layers=6, num_heads=2, head_dim=8, output_dim=8, cross_attention_dim=12), rngs=nnx.Rngs(0))))
  assert "scan[" not in str(jax.make_jaxpr(lambda x: small(x, timesteps, **inputs))(x))


def stacking_in_a_sampling_loop(once: bool, devices=None) -> list[int]:
  """How often each weight-stacking concatenate of a scanned 8-layer DiT runs when flow.euler_sample's
  4-step loop samples through it, as compiled (for `devices`, default the CPU): stacked inside every
  step (once=False) or once before the loop (DiT.stack_blocks, as GR00T's velocity_fn does)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from ejax.models import dit, flow
  from ejax.parallel import hlo

  config = dit.DiTConfig(num_layers=8, num_heads=2, head_dim=8, output_dim=16, cross_attention_dim=12)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: dit.DiT(config, rngs=nnx.Rngs(0))))
  sharding = NamedSharding(Mesh(np.asarray(devices or jax.devices()[:1]), ("d",)), P())
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)

  def sample(state, noise, vl):
    model = nnx.merge(graphdef, state)
    inputs = dict(vl_tokens=vl, vl_segment_ids=jnp.ones((2, 7), jnp.int32), sample_row=jnp.array([0, 1]),
                  sample_segment=jnp.array([1, 1]), stacked=model.stack_blocks() if once else None)
    return flow.euler_sample(lambda x, t: model(x, (t * 999).astype(jnp.int32), **inputs), noise, 4,
                             convention="groot")

  noise = jax.ShapeDtypeStruct((2, 5, config.width), jnp.float32, sharding=sharding)
  vl = jax.ShapeDtypeStruct((2, 7, 12), jnp.float32, sharding=sharding)
  module = hlo.parse(jax.jit(sample).lower(state, noise, vl).compile().as_text())
  assert max(module.runs.values()) >= 4 * 4    # the DiT's scan (4 pairs) inside the 4-step loop
  # The stacked weights: [4 pairs, ...] concatenates (the timestep embedding's sin|cos is one too).
  return [runs for runs, _, shape, op, _ in hlo._instructions(module)
          if op == "concatenate" and shape.startswith("f32[4,")]


def test_scanned_weights_are_stacked_once_per_call_not_once_per_denoising_step():
  """run_blocks stacks a scanned kind's per-layer weights at call time. GR00T's sampling loop
  (flow.euler_sample's fori_loop, its DiT scanned at full size) stacks them once before the loop
  (DiT.stack_blocks): the loop's body holds no stacking at all, on any backend. Stacked inside the
  body instead, XLA:CPU hoists it (every concatenate still runs once a call) but XLA:GPU does not
  (tests/train/test_compile_report_gpu.py: 4 runs a call, one a denoising step)."""
  from ejax.models import dit, flow

  config = dit.DiTConfig(num_layers=8, num_heads=2, head_dim=8, output_dim=16, cross_attention_dim=12)
  model = layers.host_random_init(nnx.eval_shape(lambda: dit.DiT(config, rngs=nnx.Rngs(0))), stddev=0.2)
  vl = jax.random.normal(jax.random.key(2), (2, 7, 12))
  inputs = dict(vl_tokens=vl, vl_segment_ids=jnp.ones((2, 7), jnp.int32), sample_row=jnp.array([0, 1]),
                sample_segment=jnp.array([1, 1]))
  noise = jax.random.normal(jax.random.key(1), (2, 5, config.width))

  def sample(m, noise, once):
    stacked = m.stack_blocks() if once else None
    return flow.euler_sample(lambda x, t: m(x, (t * 999).astype(jnp.int32), stacked=stacked, **inputs), noise, 4,
                             convention="groot")

  # The same numbers either way.
  np.testing.assert_allclose(nnx.jit(sample, static_argnums=2)(model, noise, True),
                             nnx.jit(sample, static_argnums=2)(model, noise, False), rtol=1e-6, atol=1e-6)
  # Stacked once: no weight stacking (jnp.stack's concatenate of [4 pairs, ...]) in the loop's body.
  jaxpr = jax.make_jaxpr(lambda noise: sample(model, noise, True))(noise)
  (loop,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("while", "scan")]   # fori_loop: a scan
  body = str(loop.params.get("jaxpr", loop.params.get("body_jaxpr")))
  # jnp.stack is a concatenate in jax 0.9's jaxprs and a `stack` primitive in 0.11's.
  stacking = ("concatenate", "stack")
  assert not [line for line in body.splitlines() if any(f" {p}[" in line for p in stacking) and "f32[4," in line]
  outside = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in stacking and eqn.outvars[0].aval.shape[0] == 4]
  assert len(outside) >= 8, "expected the stacked weights before the loop"
  # As XLA:CPU compiles it, each stacking runs once a call both ways.
  for once in (True, False):
    runs = stacking_in_a_sampling_loop(once)
    assert len(runs) >= 8 and set(runs) == {1}, f"weights re-stacked inside the sampling loop: {runs}"


def biased_self_attention_kernels(devices=None) -> list[tuple[str, str]]:
  """(kind, result shape) of each kernel a ViT-like biased self-attention (SigLIP's: 16 heads of 72)
  launches, as compiled for `devices` (default the CPU) by ejax.parallel.gpu_program."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from ejax.parallel import gpu_program
  from ejax.train.compile_report import text_with_operand_shapes

  attention = nnx.eval_shape(lambda: layers.Attention(1152, num_heads=16, use_bias=True, dtype=jnp.bfloat16,
                                                      param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(attention)
  sharding = NamedSharding(Mesh(np.asarray(devices or jax.devices()[:1]), ("d",)), P())
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
  x = jax.ShapeDtypeStruct((32, 256, 1152), jnp.bfloat16, sharding=sharding)
  compiled = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, x).compile()
  return [(k.kind, k.shape) for k in gpu_program.read(text_with_operand_shapes(compiled)).kernels]


def test_self_attention_projects_q_k_and_v_apart_with_their_biases():
  """The same numbers as one projection each (the optimization barrier that keeps XLA from merging
  them changes no value); tests/train/test_compile_report_gpu.py checks the GPU kernels."""
  attention = layers.Attention(24, num_heads=2, use_bias=True, rngs=nnx.Rngs(0))
  for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
    projection.bias[...] = jax.random.normal(jax.random.key(1), projection.bias.shape)
  x = jax.random.normal(jax.random.key(2), (2, 5, 24))
  q, k, v = attention.project_qkv(x, x)
  einsum = lambda p: jnp.einsum("...d,dhk->...hk", x, p.kernel[...]) + p.bias[...]
  for got, projection in zip((q, k, v), (attention.q_proj, attention.k_proj, attention.v_proj)):
    np.testing.assert_allclose(got, einsum(projection), rtol=1e-5, atol=1e-6)
  grad = jax.grad(lambda x: jnp.sum(jnp.square(attention(x))))(x)
  assert grad.shape == x.shape and np.all(np.isfinite(grad))


def test_dropout_draws_a_byte_an_element_at_the_rounded_rate():
  """layers.dropout: 8-bit draws, four from each 32-bit word: the rate rounded to 1/256 (0.2 -> 51/256),
  kept values scaled to an unbiased mean; each element's draw independent of its word's other bytes
  and of the next word's; a mask a key, another for another key."""
  assert layers.dropout_rate(0.2) == 51 / 256 and layers.dropout_rate(1e-4) == 1 / 256
  x = jnp.ones((512, 4096), jnp.float32)
  key = jax.random.key(3)
  out = np.asarray(jax.jit(lambda x, k: layers.dropout(x, 0.2, k))(x, key))
  keep_p = 1 - 51 / 256
  np.testing.assert_allclose(np.unique(out), [0.0, 1 / keep_p], rtol=1e-6)
  kept = out > 0
  sigma = np.sqrt(keep_p * (1 - keep_p) / kept.size)
  assert abs(kept.mean() - keep_p) < 5 * sigma, kept.mean()
  assert abs(out.mean() - 1.0) < 5 * sigma / keep_p
  for a, b in ((0, 1), (1, 2), (0, 3), (3, 4)):  # bytes of one word; across a word boundary (3, 4)
    both = (kept[:, a:a + 4092:4] & kept[:, b:b + 4092:4]).mean()
    assert abs(both - keep_p**2) < 5 * np.sqrt(keep_p**2 * (1 - keep_p**2) / (512 * 1023)), (a, b, both)
  assert abs((kept[1:] & kept[:-1]).mean() - keep_p**2) < 0.01  # rows
  np.testing.assert_array_equal(np.asarray(layers.dropout(x, 0.2, key)), out)  # jit or not: one mask
  assert (np.asarray(layers.dropout(x, 0.2, jax.random.key(4))) > 0).mean() != kept.mean()
  assert layers.dropout(x, 0.2, None) is x and layers.dropout(x, 0.0, key) is x
  odd = np.asarray(layers.dropout(jnp.ones((64, 33)), 0.2, key))  # not a multiple of 4: bernoulli at 0.2
  np.testing.assert_allclose(np.unique(odd), [0.0, 1 / 0.8], rtol=1e-6)


def test_dropout_gives_the_same_mask_on_a_sharded_mesh():
  """The draws are a function of each element's place (jax's partitionable Threefry), so a
  [tokens, hidden] activation sharded 4 x 2 over a mesh drops exactly what one device drops."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from ejax.parallel import make_mesh
  mesh = make_mesh(dict(data=1, fsdp=4, tensor=2), devices=jax.devices()[:8])
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 512)), jnp.float32)
  key = jax.random.key(7)
  one = np.asarray(jax.jit(lambda x, k: layers.dropout(x, 0.2, k))(x, key))
  sharding = NamedSharding(mesh, P("fsdp", "tensor"))
  sharded = jax.jit(lambda x, k: layers.dropout(x, 0.2, k), out_shardings=sharding)(jax.device_put(x, sharding), key)
  np.testing.assert_array_equal(np.asarray(sharded), one)
