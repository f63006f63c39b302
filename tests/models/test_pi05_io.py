"""pi0.5 weight import/export: openpi's parameter tree and LeRobot's safetensors port."""

import numpy as np
import pytest
from flax import nnx

from ejax.models import layers, pi05
from ejax.models.io import pi05_lerobot, pi05_openpi
from ejax.models.io.tensors import CheckpointMismatch, load_tensors, model_arrays, save_tensors


@pytest.fixture(scope="module")
def config():
  return pi05.model_config("runlocal")


@pytest.fixture(scope="module")
def model(config):
  # Every parameter random and distinct, so a swapped or transposed tensor cannot go unnoticed.
  return layers.host_random_init(nnx.eval_shape(lambda: pi05.create(config, nnx.Rngs(0))), seed=7, stddev=1.0)


def _assert_same_params(a, b):
  arrays_a, arrays_b = model_arrays(a), model_arrays(b)
  assert arrays_a.keys() == arrays_b.keys()
  for path in arrays_a:
    assert arrays_a[path].dtype == arrays_b[path].dtype, path
    np.testing.assert_array_equal(arrays_a[path], arrays_b[path], err_msg=path)


def test_openpi_round_trip_is_bit_exact_with_real_key_names(config, model):
  tree = pi05_openpi.export_params(model)
  llm, expert = pi05.gemma_configs(config)
  v = config.vision
  assert tree["PaliGemma/llm/embedder/input_embedding"].shape == (llm.vocab_size, llm.width)
  assert tree["PaliGemma/llm/layers/attn/q_einsum/w"].shape == (llm.depth, llm.num_heads, llm.width, llm.head_dim)
  assert tree["PaliGemma/llm/layers/attn/kv_einsum_1/w"].shape == (
      expert.depth, 2, expert.num_kv_heads, expert.width, expert.head_dim)
  assert tree["PaliGemma/llm/layers/mlp_1/gating_einsum"].shape == (expert.depth, 2, expert.width, expert.mlp_dim)
  assert tree["PaliGemma/llm/layers/pre_attention_norm_1/Dense_0/kernel"].shape == (
      expert.depth, expert.width, 3 * expert.width)
  assert tree["PaliGemma/llm/final_norm_1/Dense_0/bias"].shape == (3 * expert.width,)
  assert "PaliGemma/llm/final_norm/scale" in tree and "PaliGemma/llm/final_norm_1/scale" not in tree
  assert tree["PaliGemma/img/embedding/kernel"].shape == (v["patch_size"], v["patch_size"], 3, v["width"])
  assert tree["PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/query/kernel"].shape == (
      v["depth"], v["width"], v["num_heads"], v["width"] // v["num_heads"])
  assert tree["PaliGemma/img/head/kernel"].shape == (v["width"], llm.width)
  assert tree["time_mlp_in/kernel"].shape == (expert.width, expert.width)
  # Nested with openpi training's "/value" leaves imports too.
  nested = pi05_openpi.nest({k + "/value": x for k, x in tree.items()})
  restored = pi05_openpi.import_params(config, nested)
  _assert_same_params(model, restored)
  again = pi05_openpi.export_params(restored)
  assert again.keys() == tree.keys()
  for key in tree:
    np.testing.assert_array_equal(again[key], tree[key], err_msg=key)


def test_openpi_errors_name_missing_misshaped_and_unexpected_keys(config, model):
  tree = pi05_openpi.export_params(model)
  missing = dict(tree)
  del missing["PaliGemma/llm/layers/mlp_1/linear"]
  with pytest.raises(CheckpointMismatch, match="missing.*PaliGemma/llm/layers/mlp_1/linear"):
    pi05_openpi.import_params(config, missing)
  misshaped = dict(tree)
  misshaped["action_out_proj/kernel"] = np.zeros((3, 3), np.float32)
  with pytest.raises(CheckpointMismatch, match=r"mis-shaped.*action_out_proj/kernel: checkpoint \(3, 3\)"):
    pi05_openpi.import_params(config, misshaped)
  unexpected = dict(tree)
  unexpected["state_proj/kernel"] = np.zeros((4, 4), np.float32)  # pi0, not pi0.5
  with pytest.raises(CheckpointMismatch, match="unexpected.*state_proj/kernel"):
    pi05_openpi.import_params(config, unexpected)


def test_lerobot_round_trip_through_a_safetensors_file(config, model, tmp_path):
  path = str(tmp_path / "model.safetensors")
  pi05_lerobot.save(model, path)
  tensors = load_tensors(path)
  llm, expert = pi05.gemma_configs(config)
  root = "paligemma_with_expert"
  assert tensors[f"{root}.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"].shape == (
      llm.num_heads * llm.head_dim, llm.width)
  assert tensors[f"{root}.gemma_expert.model.layers.1.self_attn.k_proj.weight"].shape == (
      expert.num_kv_heads * expert.head_dim, expert.width)
  assert tensors[f"{root}.gemma_expert.model.layers.0.input_layernorm.dense.weight"].shape == (
      3 * expert.width, expert.width)
  assert f"{root}.gemma_expert.model.norm.dense.bias" in tensors
  assert f"{root}.paligemma.model.vision_tower.vision_model.encoder.layers.0.self_attn.out_proj.weight" in tensors
  assert f"{root}.paligemma.model.multi_modal_projector.linear.weight" in tensors
  assert tensors["action_in_proj.weight"].shape == (expert.width, config.action_dim)
  _assert_same_params(model, pi05_lerobot.load(config, path))


def test_lerobot_accepts_policy_prefix_and_unused_heads_and_names_bad_keys(config, model):
  tensors = pi05_lerobot.export_params(model, with_unused_heads=True, prefix="model.")
  _assert_same_params(model, pi05_lerobot.import_params(config, tensors))
  # Only the tied lm_head kept (safetensors drops one of a shared pair): it is the embedding.
  tied_only = dict(tensors)
  del tied_only["model." + pi05_lerobot.EMBED_TOKENS]
  _assert_same_params(model, pi05_lerobot.import_params(config, tied_only))
  key = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight"
  missing = {k: v for k, v in tensors.items() if k != "model." + key}
  with pytest.raises(CheckpointMismatch, match=f"missing.*{key}"):
    pi05_lerobot.import_params(config, missing)
  misshaped = dict(tensors)
  misshaped["model." + key] = misshaped["model." + key].T
  with pytest.raises(CheckpointMismatch, match=f"mis-shaped.*{key}"):
    pi05_lerobot.import_params(config, misshaped)


def test_the_two_layouts_agree_by_openpis_conversion_formulas(config, model):
  # openpi's examples/convert_jax_model_to_pytorch.py maps its tree to the PyTorch port with these
  # formulas; ejax's two io modules, written independently of each other, must agree with them.
  tree = pi05_openpi.export_params(model)
  torch = pi05_lerobot.export_params(model)
  llm, expert = pi05.gemma_configs(config)
  v = config.vision
  lm = "paligemma_with_expert.paligemma.model.language_model.layers"
  ex = "paligemma_with_expert.gemma_expert.model.layers"
  tower = "paligemma_with_expert.paligemma.model.vision_tower.vision_model"
  q = tree["PaliGemma/llm/layers/attn/q_einsum/w"][1]
  np.testing.assert_array_equal(torch[f"{lm}.1.self_attn.q_proj.weight"],
                                q.transpose(0, 2, 1).reshape(llm.num_heads * llm.head_dim, llm.width))
  kv = tree["PaliGemma/llm/layers/attn/kv_einsum_1/w"][0]
  np.testing.assert_array_equal(torch[f"{ex}.0.self_attn.v_proj.weight"], kv[1, 0].T)
  out = tree["PaliGemma/llm/layers/attn/attn_vec_einsum_1/w"][1]
  np.testing.assert_array_equal(torch[f"{ex}.1.self_attn.o_proj.weight"],
                                out.reshape(expert.num_heads * expert.head_dim, expert.width).T)
  gating = tree["PaliGemma/llm/layers/mlp/gating_einsum"][0]
  np.testing.assert_array_equal(torch[f"{lm}.0.mlp.up_proj.weight"], gating[1].T)
  dense = tree["PaliGemma/llm/layers/pre_ffw_norm_1/Dense_0/kernel"][1]
  np.testing.assert_array_equal(torch[f"{ex}.1.post_attention_layernorm.dense.weight"], dense.T)
  np.testing.assert_array_equal(torch[f"{tower}.embeddings.patch_embedding.weight"],
                                tree["PaliGemma/img/embedding/kernel"].transpose(3, 2, 0, 1))
  key = tree["PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/key/kernel"][0]
  np.testing.assert_array_equal(torch[f"{tower}.encoder.layers.0.self_attn.k_proj.weight"],
                                key.reshape(-1, v["width"]).T)
  np.testing.assert_array_equal(torch[f"{tower}.embeddings.position_embedding.weight"],
                                tree["PaliGemma/img/pos_embedding"].reshape(-1, v["width"]))


def test_convert_job_entry_picks_the_layout_from_the_path(config, model, tmp_path):
  from ejax.models.io import pi05 as pi05_io
  openpi_dir = str(tmp_path / "openpi_params")
  pi05_io.save(model, openpi_dir)  # orbax {"params": openpi tree}
  _assert_same_params(model, pi05_io.load(config, openpi_dir))
  lerobot_file = str(tmp_path / "lerobot" / "model.safetensors")
  pi05_io.save(model, lerobot_file)
  _assert_same_params(model, pi05_io.load(config, str(tmp_path / "lerobot")))
