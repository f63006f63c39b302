"""DreamZero weight import / export (issue 32, deliverable 2): tiny checkpoints in the released DreamZero
layout and in the Wan DiT / umT5 / CLIP / Wan VAE layouts, written as safetensors and read back, with the
layouts checked against PyTorch semantics computed independently (Linear, Conv3d, Conv2d)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.models import layers
from ejax.models.dreamzero import model as dz
from ejax.models.io import dreamzero as io
from ejax.models.io.tensors import CheckpointMismatch, load_tensors, param_shapes, save_tensors


@pytest.fixture(scope="module")
def tiny():
  config = dz.model_config("runlocal")
  model = layers.host_random_init(nnx.eval_shape(lambda: dz.create(config, nnx.Rngs(0))), 1, stddev=0.5)
  return config, model


def test_release_layout_round_trip(tiny, tmp_path):
  config, model = tiny
  path = str(tmp_path / "model.safetensors")
  tensors = io.to_release(model)
  # The official key names and PyTorch shapes (runlocal: dim 64, 4 latent channels, VAE dim 8).
  expect = {
      "action_head.model.patch_embedding.weight": (64, 4, 1, 2, 2),
      "action_head.model.blocks.1.self_attn.q.weight": (64, 64),
      "action_head.model.blocks.0.cross_attn.norm_k_img.weight": (64,),
      "action_head.model.blocks.0.modulation": (1, 6, 64),
      "action_head.model.head.modulation": (1, 2, 64),
      "action_head.model.img_emb.proj.4.bias": (64,),
      "action_head.model.action_encoder.W2.W": (1, 128, 64),
      "action_head.text_encoder.blocks.1.pos_embedding.embedding.weight": (32, 4),
      "action_head.text_encoder.blocks.0.ffn.gate.0.weight": (64, 32),
      "action_head.image_encoder.model.visual.transformer.1.attn.to_qkv.weight": (96, 32),
      "action_head.image_encoder.model.visual.pos_embedding": (1, 5, 32),
      "action_head.vae.model.encoder.downsamples.0.residual.0.gamma": (8, 1, 1, 1),
      "action_head.vae.model.encoder.downsamples.5.time_conv.weight": (16, 16, 3, 1, 1),
      "action_head.vae.model.encoder.middle.1.to_qkv.weight": (48, 16, 1, 1),
      "action_head.vae.model.decoder.upsamples.3.resample.1.weight": (8, 16, 3, 3),
  }
  for key, shape in expect.items():
    assert tensors[key].shape == shape, key
  assert sum(t.size for t in tensors.values()) == sum(np.prod(s) for s in param_shapes(model).values())
  # The CLIP text tower rides along in released files and is accepted as known-unused.
  tensors["action_head.image_encoder.model.textual.token_embedding.weight"] = np.zeros((3, 2), np.float32)
  save_tensors(tensors, path)
  imported = io.load(config, path)
  original, restored = nnx.to_flat_state(nnx.state(model, nnx.Param)), dict(nnx.to_flat_state(nnx.state(imported, nnx.Param)))
  for p, v in original:
    np.testing.assert_array_equal(np.asarray(restored[p].get_value()), np.asarray(v.get_value()), err_msg=str(p))
  io.save(imported, str(tmp_path / "again.safetensors"))
  again = load_tensors(str(tmp_path / "again.safetensors"))
  assert set(again) == set(tensors) - {"action_head.image_encoder.model.textual.token_embedding.weight"}
  for key in again:
    np.testing.assert_array_equal(again[key], tensors[key], err_msg=key)


def test_layouts_follow_pytorch_semantics(tiny):
  """Released tensors act as torch would use them: Linear y = x W^T + b, Conv3d / Conv2d
  cross-correlation over [out, in, *kernel] (computed here with NCDHW convolutions)."""
  _, model = tiny
  tensors = io.to_release(model)
  rng = np.random.default_rng(0)
  w, b = tensors["action_head.model.text_embedding.0.weight"], tensors["action_head.model.text_embedding.0.bias"]
  x = rng.normal(size=(2, w.shape[1])).astype(np.float32)
  np.testing.assert_allclose(model.dit.text_embedding.fc1(x), x @ w.T + b, rtol=1e-5, atol=1e-5)
  # The patch embedding: a Conv3d with stride = kernel = (1, 2, 2) over [b, c, t, h, w] latents.
  w, b = tensors["action_head.model.patch_embedding.weight"], tensors["action_head.model.patch_embedding.bias"]
  latents = rng.normal(size=(1, 3, 4, 4, 4)).astype(np.float32)  # [b, t, h, w, c]
  torch_like = jax.lax.conv_general_dilated(latents.transpose(0, 4, 1, 2, 3), w, (1, 2, 2), "VALID",
                                            dimension_numbers=("NCDHW", "OIDHW", "NCDHW")) + b[:, None, None, None]
  ours = model.dit.patch_embedding(dz.patchify(latents, (1, 2, 2)))
  np.testing.assert_allclose(ours, torch_like.reshape(1, 64, -1).transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
  # A VAE causal Conv3d (padding 1: two past frames, one pixel each side) and a Resample Conv2d.
  w, b = tensors["action_head.vae.model.encoder.conv1.weight"], tensors["action_head.vae.model.encoder.conv1.bias"]
  video = rng.normal(size=(1, 5, 6, 6, 3)).astype(np.float32)
  padded = np.pad(video.transpose(0, 4, 1, 2, 3), [(0, 0), (0, 0), (2, 0), (1, 1), (1, 1)])
  torch_like = jax.lax.conv_general_dilated(padded, w, (1, 1, 1), "VALID",
                                            dimension_numbers=("NCDHW", "OIDHW", "NCDHW")) + b[:, None, None, None]
  np.testing.assert_allclose(model.vae.encoder.conv1(video), np.asarray(torch_like).transpose(0, 2, 3, 4, 1),
                             rtol=1e-4, atol=1e-4)
  w = tensors["action_head.vae.model.encoder.downsamples.2.resample.1.weight"]
  b = tensors["action_head.vae.model.encoder.downsamples.2.resample.1.bias"]
  frames = rng.normal(size=(1, 2, 6, 6, 8)).astype(np.float32)
  torch_like = jax.lax.conv_general_dilated(np.pad(frames[0].transpose(0, 3, 1, 2), [(0, 0), (0, 0), (0, 1), (0, 1)]),
                                            w, (2, 2), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
  np.testing.assert_allclose(model.vae.encoder.downsamples[2].conv(frames)[0],
                             np.asarray(torch_like + b[:, None, None]).transpose(0, 2, 3, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("component,key", [("dit", "blocks.0.cross_attn.k_img.weight"),
                                           ("text_encoder", "blocks.0.attn.q.weight"),
                                           ("image_encoder", "transformer.0.mlp.0.weight"),
                                           ("vae", "encoder.middle.0.residual.2.weight")])
def test_component_releases_round_trip(tiny, tmp_path, component, key):
  """The Wan DiT, umT5, CLIP and Wan VAE files: their own keys, no DreamZero prefix; a Wan DiT has no
  action / state modules."""
  _, model = tiny
  path = str(tmp_path / f"{component}.safetensors")
  io.save_component(model, component, path)
  tensors = load_tensors(path)
  assert key in tensors and not any(k.startswith("action_head.") for k in tensors)
  assert not any(k.startswith(("state_encoder", "action_encoder", "action_decoder")) for k in tensors)
  arrays = io.load_component(model, component, path)
  current = {"/".join(str(getattr(p, "key", p)) for p in path_): v.get_value()
             for path_, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert arrays and all(np.array_equal(arrays[p], current[p]) for p in arrays)


def test_mismatches_are_named(tiny, tmp_path):
  config, model = tiny
  tensors = io.to_release(model)
  del tensors["action_head.model.blocks.1.ffn.2.bias"]
  tensors["action_head.model.head.head.weight"] = np.zeros((3, 64), np.float32)
  tensors["action_head.model.lora_A"] = np.zeros((1,), np.float32)
  with pytest.raises(CheckpointMismatch) as error:
    io.from_release(config, tensors)
  message = str(error.value)
  for part in ("action_head.model.blocks.1.ffn.2.bias", "action_head.model.head.head.weight: checkpoint (3, 64)",
               "action_head.model.lora_A"):
    assert part in message


def test_full_size_key_maps_cover_every_parameter():
  """From shapes alone: every 14B parameter has a released key, and the counts agree; the 5B's VAE
  (shape-correct only) refuses with one line."""
  config = dz.model_config("14b")
  abstract = nnx.eval_shape(lambda: dz.create(config, nnx.Rngs(0)))
  shapes = param_shapes(abstract)
  entries = io.all_entries(abstract, shapes)
  assert len(entries) == len(shapes)
  assert io.parameter_count(entries) == sum(int(np.prod(s)) for s in shapes.values())
  assert io.parameter_count(io.component_entries(abstract, "dit", shapes)) == pytest.approx(16.39e9, rel=0.01)
  with pytest.raises(CheckpointMismatch, match="error: the Wan 2.2 VAE is shape-correct only"):
    io.from_release(dz.model_config("5b"), {})


def test_convert_job_imports_and_exports_a_release(tiny, tmp_path):
  """The convert job finds ejax.models.io.dreamzero by the model's name: release -> orbax -> release."""
  from configs import dreamzero as dreamzero_config
  from ejax.models.io import convert
  _, model = tiny
  io.save(model, str(tmp_path / "release" / "model.safetensors"))
  config = dreamzero_config.get_config("runlocal,dataset=synthetic")  # the Wan 2.1 VAE (runlocal on cameras patchifies, as 2.2)
  config.convert.update(direction="import", source=str(tmp_path / "release"), destination=str(tmp_path / "ejax"))
  convert.run_job(config, "")
  config.convert.update(direction="export", source=str(tmp_path / "ejax"), destination=str(tmp_path / "out.safetensors"))
  convert.run_job(config, "")
  released, exported = load_tensors(str(tmp_path / "release")), load_tensors(str(tmp_path / "out.safetensors"))
  assert set(released) == set(exported)
  for key in released:
    np.testing.assert_array_equal(exported[key], released[key], err_msg=key)
