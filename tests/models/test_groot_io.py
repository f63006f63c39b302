"""GR00T weight import/export against the released key names, and the convert job."""

import ml_collections
import numpy as np
import pytest
from flax import nnx

from ejax.models import groot, layers
from ejax.models.io import convert, groot as groot_io, tensors


def small_config():
  """The released architecture (1-layer connector, Qwen3 with QK-norm, AdaLN DiT) at toy widths."""
  c = groot.model_config("runlocal")
  c.vision.depth = 1
  c.llm.num_layers = 1
  return c


@pytest.fixture(scope="module")
def release(tmp_path_factory):
  c = small_config()
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=7, stddev=0.5)
  path = str(tmp_path_factory.mktemp("release") / "model.safetensors")
  groot_io.save(model, path)
  return c, model, path


def test_release_keys_are_the_isaac_gr00t_names(release):
  c, _, path = release
  keys = set(tensors.load_tensors(path))
  for key, shape in {
      "backbone.eagle_model.vision_model.vision_model.embeddings.patch_embedding.weight": (32, 3, 8, 8),
      "backbone.eagle_model.vision_model.vision_model.encoder.layers.0.self_attn.out_proj.weight": (32, 32),
      "backbone.eagle_model.mlp1.0.weight": (64, 32),
      "backbone.eagle_model.language_model.model.layers.0.self_attn.k_proj.weight": (32, 64),
      "backbone.eagle_model.language_model.model.layers.0.self_attn.q_norm.weight": (16,),
      "action_head.model.transformer_blocks.0.attn1.to_k.weight": (64, 64),    # cross: from VL width
      "action_head.model.transformer_blocks.1.attn1.to_k.weight": (64, 64),
      "action_head.model.transformer_blocks.0.norm1.linear.weight": (128, 64),
      "action_head.model.timestep_encoder.timestep_embedder.linear_1.weight": (64, 256),
      "action_head.vl_self_attention.transformer_blocks.0.ff.net.0.proj.weight": (256, 64),
      "action_head.state_encoder.layer1.W": (2, 8, 64),
      "action_head.action_encoder.W2.W": (2, 128, 64),
      "action_head.vlln.weight": (64,),
      "action_head.future_tokens.weight": (4, 64),
  }.items():
    assert key in keys, key
    assert tensors.load_tensors(path)[key].shape == shape, key
  assert not any("norm3" in k for k in keys if k.startswith("action_head.model."))  # DiT norms carry no weights


def test_export_import_round_trip_is_bit_exact(release):
  c, model, path = release
  loaded = groot_io.load(c, path)
  for name, value in tensors.model_arrays(model).items():
    np.testing.assert_array_equal(tensors.model_arrays(loaded)[name], value, err_msg=name)
  first, second = tensors.load_tensors(path), groot_io.to_release(loaded)
  assert first.keys() == second.keys()
  for key in first:
    assert first[key].dtype == second[key].dtype and np.array_equal(first[key], second[key]), key


def test_mismatches_name_the_tensor(release, tmp_path):
  c, _, path = release
  good = tensors.load_tensors(path)
  missing = dict(good)
  del missing["action_head.model.proj_out_2.bias"]
  with pytest.raises(tensors.CheckpointMismatch, match="missing.*action_head.model.proj_out_2.bias"):
    groot_io.from_release(c, missing)
  misshaped = dict(good)
  misshaped["backbone.eagle_model.mlp1.0.weight"] = np.zeros((64, 33), np.float32)
  with pytest.raises(tensors.CheckpointMismatch, match=r"mis-shaped.*mlp1.0.weight: checkpoint \(64, 33\)"):
    groot_io.from_release(c, misshaped)
  unexpected = dict(good, **{"action_head.extra.weight": np.zeros(3, np.float32)})
  with pytest.raises(tensors.CheckpointMismatch, match="unexpected.*action_head.extra.weight"):
    groot_io.from_release(c, unexpected)
  # The SigLIP pooling head and a tied lm_head are known-unused: accepted, not silently required.
  known = dict(good, **{groot_io.VISION + "head.probe": np.zeros((1, 1, 32), np.float32)})
  groot_io.from_release(c, known)


def test_convert_job_import_then_export(release, tmp_path):
  c, _, path = release
  config = ml_collections.ConfigDict(dict(model=c, convert=dict(direction="import", source=path,
                                                                 destination=str(tmp_path / "ejax"))))
  convert.run_job(config, str(tmp_path))
  config.convert = dict(direction="export", source=str(tmp_path / "ejax"), destination=str(tmp_path / "out.safetensors"))
  convert.run_job(config, str(tmp_path))
  first, second = tensors.load_tensors(path), tensors.load_tensors(str(tmp_path / "out.safetensors"))
  assert first.keys() == second.keys()
  assert all(np.array_equal(first[k], second[k]) for k in first)
  with pytest.raises(ValueError, match="no weight converter for model 'nope'"):
    convert.converter("nope")
