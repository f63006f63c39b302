"""Opt-in parity (`pytest -m parity`): ejax's Gemma decoder and SigLIP tower against Hugging Face
transformers' PyTorch implementations, loaded with the same random weights through ejax's LeRobot
export (whose keys are transformers' own below the `paligemma_with_expert.paligemma.model.` prefix).

Needs torch (CPU) and transformers. The full mixture-of-transformers pi0.5 against LeRobot's
PI05Policy is not covered: lerobot's pi05 needs its own patched Gemma classes and dependencies.
"""

import numpy as np
import pytest
from flax import nnx

from tests.models.parity import assert_matches, require_parity, strip_prefix

from ejax.models import gemma, layers, pi05
from ejax.models.io import pi05_lerobot

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def setup(request):
  torch = require_parity(request)
  config = pi05.model_config("runlocal")
  model = layers.host_random_init(nnx.eval_shape(lambda: pi05.create(config, nnx.Rngs(0))), seed=3, stddev=0.2)
  tensors = {k: torch.from_numpy(np.array(v)) for k, v in pi05_lerobot.export_params(model).items()}
  return torch, config, model, tensors


def test_gemma_decoder_matches_transformers_gemma(setup):
  torch, config, model, tensors = setup
  from transformers import GemmaConfig, GemmaModel

  c = dict(config.paligemma)
  hf = GemmaModel(GemmaConfig(
      vocab_size=c["vocab_size"], hidden_size=c["width"], intermediate_size=c["mlp_dim"],
      num_hidden_layers=c["depth"], num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
      head_dim=c["head_dim"], hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10_000.0,
      attn_implementation="eager"))
  hf.load_state_dict(strip_prefix(tensors, "paligemma_with_expert.paligemma.model.language_model."), strict=True)
  tokens = np.random.default_rng(0).integers(1, c["vocab_size"], (2, 12))
  with torch.no_grad():
    expected = hf(input_ids=torch.from_numpy(tokens)).last_hidden_state.numpy()
  positions = np.broadcast_to(np.arange(12), (2, 12))
  ours = np.asarray(gemma.causal_lm_forward(model.llm, tokens, np.ones((2, 12), np.int32), positions))
  assert_matches("gemma", ours, expected, atol=2e-4, rtol=2e-4)


def test_siglip_tower_matches_transformers_siglip(setup):
  torch, config, model, tensors = setup
  from transformers import SiglipVisionConfig, SiglipVisionModel

  v = dict(config.vision)
  hf = SiglipVisionModel(SiglipVisionConfig(
      hidden_size=v["width"], intermediate_size=v["mlp_dim"], num_hidden_layers=v["depth"],
      num_attention_heads=v["num_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
      hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False, attn_implementation="eager"))
  hf.load_state_dict(strip_prefix(tensors, "paligemma_with_expert.paligemma.model.vision_tower.vision_model."), strict=True)
  images = np.random.default_rng(1).uniform(-1, 1, (2, v["image_size"], v["image_size"], 3)).astype(np.float32)
  with torch.no_grad():
    expected = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).last_hidden_state.numpy()
  ours = np.asarray(model.vision(images))
  assert_matches("siglip", ours, expected, atol=2e-4, rtol=2e-4)
