"""Opt-in parity (`pytest -m parity`): GR00T-N1.5's backbone in ejax against Hugging Face
transformers' independent PyTorch modules, with the same random weights on both sides.

The weights travel through ejax's GR00T checkpoint I/O: a random model is exported to the released
key layout (`ejax.models.io.groot.to_release`), every norm scale and bias is then perturbed (so
that ones/zeros cannot hide a transposed or dropped tensor), the result is imported back into ejax
(`from_release`) and the same tensors are loaded, with `strict=True`, into
  - transformers' Qwen3Model (keys below `backbone.eagle_model.language_model.model.`), built with
    `select_layer` layers: GR00T truncates the LLM by dropping the later layers, so its VL features
    are the final RMSNorm applied to the output of layer `select_layer`;
  - transformers' SiglipVisionModel (keys below `backbone.eagle_model.vision_model.vision_model.`; Eagle 2.5's
    SigLIP2 tower has SigLIP's conv-patch layout, not Siglip2VisionModel's NaFlex linear patches);
  - a torch Linear as the 1-layer `mlp1` connector of the released checkpoint.
The full backbone test runs ejax's GrootBackbone on packed rows (two prompts per row, image tokens
scattered in) and compares each sample with the transformers composition run on that sample alone.

Not covered: the action head (VL self-attention, DiT, per-embodiment MLPs), which has no
installable reference here (Isaac-GR00T / LeRobot need torchvision, absent for this machine's CPU torch).
"""

import numpy as np
import pytest
from flax import nnx

from tests.models.parity import assert_matches, require_parity, strip_prefix

from ejax.models import groot, groot_inputs, layers
from ejax.models.io import groot as groot_io

pytestmark = pytest.mark.parity

TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def setup(request):
  torch = require_parity(request)
  config = groot.model_config("runlocal")
  config.num_cameras = 1                      # image tokens in every prompt (runlocal has none)
  config.llm = dict(config.llm, num_layers=3, rope_theta=1_000_000.0)   # select_layer 3, published theta
  random = layers.host_random_init(nnx.eval_shape(lambda: groot.create(config, nnx.Rngs(0))), seed=3, stddev=0.2)
  released = groot_io.to_release(random)
  rng = np.random.default_rng(4)
  for key, value in released.items():
    if key.endswith(".bias") or "norm" in key.split(".")[-2]:   # biases and every norm's weight
      released[key] = (value + rng.normal(0.0, 0.2, value.shape)).astype(value.dtype)
  model = groot_io.from_release(config, released)
  tensors = {k: torch.from_numpy(np.array(v)) for k, v in released.items()}
  return torch, config, model, tensors


def _hf_qwen3(config, tensors):
  from transformers import Qwen3Config, Qwen3Model
  c = dict(config.llm)
  hf = Qwen3Model(Qwen3Config(
      vocab_size=c["vocab_size"], hidden_size=c["width"], intermediate_size=c["mlp_dim"],
      num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
      head_dim=c["head_dim"], rms_norm_eps=1e-6, rope_theta=c["rope_theta"], attention_bias=False,
      attn_implementation="eager"))
  assert hf.config.rope_parameters["rope_theta"] == c["rope_theta"], hf.config.rope_parameters
  hf.load_state_dict(strip_prefix(tensors, groot_io.LLM + "model."), strict=True)
  return hf.eval()


def _hf_siglip(config, tensors):
  from transformers import SiglipVisionConfig, SiglipVisionModel
  v = dict(config.vision)
  hf = SiglipVisionModel(SiglipVisionConfig(
      hidden_size=v["width"], intermediate_size=v["mlp_dim"], num_hidden_layers=v["depth"],
      num_attention_heads=v["num_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
      hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False, attn_implementation="eager"))
  hf.load_state_dict(strip_prefix(tensors, groot_io.VISION), strict=True)
  return hf.eval()


def _hf_connector(torch, config, tensors):
  assert config.connector.num_layers == 1 and not config.connector.use_pixel_shuffle
  mlp1 = torch.nn.Sequential(torch.nn.Linear(config.vision.width, config.llm.width))
  mlp1.load_state_dict(strip_prefix(tensors, groot_io.CONNECTOR), strict=True)
  return mlp1.eval()


def test_qwen3_decoder_matches_transformers_qwen3(setup):
  torch, config, model, tensors = setup
  hf = _hf_qwen3(config, tensors)
  tokens = np.random.default_rng(0).integers(0, config.llm.vocab_size, (2, 20))
  with torch.no_grad():
    expected = hf(input_ids=torch.from_numpy(tokens)).last_hidden_state.numpy()
  positions = np.broadcast_to(np.arange(20), (2, 20))
  llm = model.backbone.llm
  ours = np.asarray(llm(llm.embed(tokens), np.ones((2, 20), np.int32), positions))
  assert_matches("qwen3 (select_layer 3)", ours, expected, **TOLERANCE)


def test_siglip_tower_matches_transformers_siglip(setup):
  torch, config, model, tensors = setup
  hf = _hf_siglip(config, tensors)
  size = config.vision.image_size
  images = np.random.default_rng(1).uniform(-1, 1, (2, size, size, 3)).astype(np.float32)
  with torch.no_grad():
    expected = hf(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).last_hidden_state.numpy()
  ours = np.asarray(model.backbone.vision(images))
  assert_matches("siglip vision", ours, expected, **TOLERANCE)


def test_backbone_on_packed_rows_matches_transformers_composition(setup):
  """Packed ejax backbone (uint8 images -> SigLIP -> mlp1 -> image tokens in the prompt -> Qwen3)
  against the transformers modules run on each sample alone, unpacked."""
  torch, config, model, tensors = setup
  qwen, siglip, mlp1 = _hf_qwen3(config, tensors), _hf_siglip(config, tensors), _hf_connector(torch, config, tensors)
  n = 4
  batch = groot_inputs.example_batch(config, n, seed=5)
  assert (batch["vl_segment_ids"].max(axis=1) > 1).any(), "the example batch should pack several prompts per row"
  ours = np.asarray(model.backbone(batch))                                    # [rows, row_length, width]

  rows = groot_inputs.sample_rows(batch)
  per_image = groot_inputs.tokens_per_image(config)
  errors = []
  for i in range(n):
    in_sample = batch["vl_segment_ids"][rows[i]] == batch["sample_segment"][i]
    tokens = batch["vl_tokens"][rows[i]][in_sample]
    pixels = torch.from_numpy(batch["images"][i:i + 1].transpose(0, 3, 1, 2).astype(np.float32))
    pixels = (pixels / 255.0 - 0.5) / 0.5                                     # SigLIP mean/std 0.5
    with torch.no_grad():
      image_embeds = mlp1(siglip(pixel_values=pixels).last_hidden_state)[0]  # [per_image, width]
      embeds = qwen.embed_tokens(torch.from_numpy(tokens.astype(np.int64)))
      is_image = torch.from_numpy(tokens == config.image_token_id)
      assert int(is_image.sum()) == per_image
      embeds[is_image] = image_embeds
      expected = qwen(inputs_embeds=embeds[None]).last_hidden_state[0].numpy()
    errors.append(np.abs(ours[rows[i]][in_sample] - expected).max())
    np.testing.assert_allclose(ours[rows[i]][in_sample], expected, **TOLERANCE)
  print(f"backbone (packed, {n} samples) max abs error {max(errors):.2e}")
