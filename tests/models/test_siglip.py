"""The SigLIP vision tower's optional convolutional stem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models.siglip import SiglipConfig, SiglipVisionTransformer, _Conv, sincos_2d


def _reference_conv(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
  """Stride-2 3x3 convolution with one pixel of zero padding, NHWC, written out as loops."""
  n, h, w, _ = x.shape
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  out = np.zeros((n, h // 2, w // 2, kernel.shape[-1]), np.float64)
  for i in range(h // 2):
    for j in range(w // 2):
      window = padded[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3, :]
      out[:, i, j] = np.einsum("nhwc,hwco->no", window, kernel)
  return out + bias


def test_stem_convolution_matches_a_loop_reference():
  conv = _Conv(3, 5, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  conv.bias[...] = jnp.arange(5, dtype=jnp.float32) / 10
  x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
  np.testing.assert_allclose(conv(jnp.asarray(x)),
                             _reference_conv(x, np.asarray(conv.kernel[...]), np.asarray(conv.bias[...])),
                             rtol=1e-5, atol=1e-5)


def test_stem_keeps_the_patch_grid_and_trains():
  config = SiglipConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4, image_size=16,
                        conv_stem=[8, 12])
  assert config.conv_stem == (8, 12)
  tower = SiglipVisionTransformer(config, rngs=nnx.Rngs(0))
  assert tower.stem_patch == 1 and tower.patch_embedding.kernel.shape == (12, 16)
  images = jax.random.uniform(jax.random.key(1), (3, 16, 16, 3), minval=-1, maxval=1)
  assert tower(images).shape == (3, config.num_patches, 16) == (3, 16, 16)
  grads = nnx.grad(lambda t: jnp.sum(t(images) ** 2))(tower)
  assert float(jnp.abs(grads.conv_stem[0].kernel[...]).sum()) > 0
  plain = SiglipVisionTransformer(SiglipConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4,
                                               image_size=16), rngs=nnx.Rngs(0))
  assert len(plain.conv_stem) == 0 and plain.patch_embedding.kernel.shape == (48, 16)


def test_stem_deeper_than_the_patch_is_refused():
  with pytest.raises(ValueError, match="conv_stem has 3 stride-2 layers; patch_size=4"):
    SiglipVisionTransformer(SiglipConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4, image_size=16,
                                         conv_stem=(4, 4, 4)), rngs=nnx.Rngs(0))


def test_sincos_position_codes_tell_every_patch_apart_and_initialise_the_table():
  codes = sincos_2d(4, 16)
  assert codes.shape == (16, 16) and np.abs(codes).max() <= 1
  distances = np.linalg.norm(codes[:, None] - codes[None], axis=-1)
  assert distances[~np.eye(16, dtype=bool)].min() > 0.1
  # Neighbours are closer than far patches: the code is smooth in both directions.
  assert distances[0, 1] < distances[0, 3] and distances[0, 4] < distances[0, 12]
  tower = SiglipVisionTransformer(SiglipConfig(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4,
                                               image_size=16, posemb_init="sincos2d"), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(tower.position_embedding[...], codes)
  with pytest.raises(ValueError, match="posemb_init='sincos2d' needs a width divisible by 4"):
    sincos_2d(4, 18)
