"""GR00T input assembly from pipeline samples, with a tiny Qwen-style BPE tokenizer built here."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ejax.models import groot, groot_inputs
from ejax.models.qwen_tokenizer import IMAGE_CONTEXT, IMAGE_END, IMAGE_START, QwenTokenizer, eagle_prompt

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_START, IMAGE_END, IMAGE_CONTEXT]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  """A byte-level BPE tokenizer.json like Qwen's (tiny vocabulary, same added tokens)."""
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  corpus = ["pick up the red cube", "place the cube in the bowl", "open the drawer", "user assistant\n"] * 20
  bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  bpe.save(str(path))
  return QwenTokenizer.from_file(str(path.parent))


def config_for(tokenizer):
  c = groot.model_config("runlocal")
  c.num_cameras = 2
  c.image_token_id = tokenizer.token_id(IMAGE_CONTEXT)
  c.packing.row_length = 128
  return c


def sample(rng, task, state_dim, action_dim, pads, embodiment):
  s = {"observation.state": rng.normal(size=state_dim).astype(np.float32),
       "observation.images.wrist": rng.integers(0, 256, (48, 48, 3), dtype=np.uint8),
       "observation.images.front": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
       "action": rng.normal(size=(8, action_dim)).astype(np.float32),
       "action_is_pad": np.arange(8) >= 8 - pads, "task": task, "embodiment_id": embodiment}
  return s


def test_tokenizer_round_trip_and_prompt(tokenizer):
  ids = tokenizer.encode("pick up the red cube")
  assert tokenizer.decode(ids) == "pick up the red cube"
  prompt = eagle_prompt(tokenizer, "open the drawer", num_images=2, tokens_per_image=3)
  context = tokenizer.token_id(IMAGE_CONTEXT)
  assert prompt.count(context) == 6 and prompt.count(tokenizer.token_id(IMAGE_START)) == 2
  text = tokenizer.decode(prompt)
  assert text.startswith("<|im_start|>user\n<img>") and "open the drawer<|im_end|>" in text
  first = tokenizer.decode(eagle_prompt(tokenizer, "open the drawer", num_images=2, tokens_per_image=3,
                                        text_first=True))
  assert first.startswith("<|im_start|>user\nopen the drawer\n<img>") and first.endswith("</img>\n<|im_end|>\n<|im_start|>assistant\n")
  with pytest.raises(KeyError, match="<unknown>"):
    tokenizer.token_id("<unknown>")
  with pytest.raises(FileNotFoundError, match="tokenizer_path"):
    QwenTokenizer.from_file("/nonexistent/tokenizer.json")


@pytest.mark.parametrize("text_first", [False, True])
def test_collate_pads_masks_and_packs(tokenizer, text_first):
  c = config_for(tokenizer)
  c.text_first = text_first
  rng = np.random.default_rng(0)
  samples = [sample(rng, "pick up the red cube", 5, 3, 2, 1), sample(rng, "open the drawer", 8, 4, 0, 0),
             sample(rng, "place the cube in the bowl", 2, 1, 5, 1)]
  batch = groot_inputs.collate(samples, c, tokenizer)
  per_image = groot.tokens_per_image(c)
  assert batch["images"].shape == (6, 32, 32, 3)          # resized to the model's image size
  assert batch["state"].shape == (3, 8) and np.array_equal(batch["state"][0, 5:], np.zeros(3))
  np.testing.assert_array_equal(batch["state"][0, :5], samples[0]["observation.state"])
  assert batch["actions"].shape == (3, 8, 4)
  np.testing.assert_array_equal(batch["action_mask"][0].sum(axis=1), [3] * 6 + [0] * 2)
  np.testing.assert_array_equal(batch["action_mask"][2].sum(axis=1), [1] * 3 + [0] * 5)
  np.testing.assert_array_equal(batch["embodiment_id"], [1, 0, 1])
  rows = groot_inputs.sample_rows(batch)
  image_index = groot_inputs.image_token_indices(batch, per_image)
  for i in range(3):
    row, segment = rows[i], batch["sample_segment"][i]
    in_sample = batch["vl_segment_ids"][row] == segment
    tokens = batch["vl_tokens"][row][in_sample]
    text = tokenizer.decode(list(tokens))
    assert text.count(samples[i]["task"]) == 1
    # model.text_first: the instruction precedes the images (so image tokens attend to it).
    assert (text.index(samples[i]["task"]) < text.index(IMAGE_START)) == text_first
    np.testing.assert_array_equal(batch["vl_positions"][row][in_sample], np.arange(in_sample.sum()))
    is_image = tokens == c.image_token_id
    np.testing.assert_array_equal(image_index[row][in_sample][is_image], i * 2 * per_image + np.arange(2 * per_image))
  assert batch["vl_tokens"].shape == (groot_inputs.rows_for(c, 3), 128)
  assert (batch["vl_tokens"][batch["vl_segment_ids"] == 0] == 0).all()


def test_collate_carries_the_auxiliary_target_where_a_sample_has_one(tokenizer):
  from ejax.models import perception
  c = config_for(tokenizer)
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.estimate.update(dim=3, to_state=False)
  c.perception.detectors.update(points=0, to_state=False)
  rng = np.random.default_rng(0)
  samples = [sample(rng, "pick up the red cube", 5, 3, 2, 1), sample(rng, "open the drawer", 8, 4, 0, 0)]
  samples[0]["observation.environment_state"] = np.array([0.1, 0.2, 0.3], np.float32)
  batch = groot_inputs.collate(samples, c, tokenizer, aux_key="observation.environment_state")
  np.testing.assert_array_equal(batch["aux_state"], np.array([[0.1, 0.2, 0.3], [0, 0, 0]], np.float32))
  np.testing.assert_array_equal(batch["aux_mask"], [1, 0])
  assert "aux_state" not in groot_inputs.collate(samples, config_for(tokenizer), tokenizer)  # off by default
  samples[1]["observation.environment_state"] = np.zeros(4, np.float32)
  with pytest.raises(ValueError, match="estimate.dim is 3"):
    groot_inputs.collate(samples, c, tokenizer, aux_key="observation.environment_state")


def test_collate_errors_name_the_fix(tokenizer):
  c = config_for(tokenizer)
  rng = np.random.default_rng(1)
  one_camera = sample(rng, "open the drawer", 3, 3, 0, 0)
  del one_camera["observation.images.front"]
  with pytest.raises(ValueError, match="num_cameras=2"):
    groot_inputs.collate([one_camera], c, tokenizer)
  with pytest.raises(ValueError, match="max_action_dim"):
    groot_inputs.collate([sample(rng, "open the drawer", 3, 9, 0, 0)], c, tokenizer)
  c.packing.row_length = 40
  with pytest.raises(ValueError, match="row_length"):
    groot_inputs.collate([sample(rng, "open the drawer", 3, 3, 0, 0)], c, tokenizer)


def test_byte_tokenizer_collates_without_a_tokenizer_file():
  c = groot.model_config("runlocal")
  c.num_cameras = 1
  c.packing.row_length = 128
  collate = groot_inputs.make_collate(c)
  rng = np.random.default_rng(2)
  s = sample(rng, "open the drawer", 3, 2, 0, 1)
  del s["observation.images.front"]
  batch = collate([s, dict(s, task="pick")])
  tokens = batch["vl_tokens"][batch["vl_segment_ids"] == batch["sample_segment"][0]]
  assert bytes(t for t in tokens if t < 256).decode().count("open the drawer") == 1
  assert int((batch["vl_tokens"] == c.image_token_id).sum()) == 2 * groot.tokens_per_image(c)
  assert int(batch["vl_tokens"].max()) < c.llm.vocab_size


def test_process_local_batches_concatenate_into_a_correct_global_batch():
  """Multi-host: each process collates its own samples; concatenating along dim 0 must keep every
  sample pointing at its own row and image tokens."""
  c = groot.model_config("runlocal")
  c.num_cameras = 1
  local = [groot.example_batch(c, 4, seed=s) for s in (0, 1)]
  merged = {k: np.concatenate([b[k] for b in local]) for k in local[0]}
  per_image = groot.tokens_per_image(c)
  rows, index = groot_inputs.sample_rows(merged), groot_inputs.image_token_indices(merged, per_image)
  for i in range(8):
    part, j = divmod(i, 4)
    local_rows = groot_inputs.sample_rows(local[part])
    np.testing.assert_array_equal(rows[i], local_rows[j] + part * local[part]["vl_tokens"].shape[0])
    in_sample = merged["vl_segment_ids"][rows[i]] == merged["sample_segment"][i]
    is_image = merged["vl_tokens"][rows[i]][in_sample] == c.image_token_id
    np.testing.assert_array_equal(index[rows[i]][in_sample][is_image], i * per_image + np.arange(per_image))


def test_synthetic_demonstrations_collate_without_cameras():
  from ejax.data.synthetic import SyntheticDemos
  c = groot.model_config("runlocal")
  demos = SyntheticDemos(state_dim=c.state_dim, action_dim=c.action_dim, horizon=c.horizon, num_tasks=c.num_tasks)
  batch = groot_inputs.make_collate(c)([demos.sample(i) for i in range(4)])
  assert batch["images"].shape[0] == 0 and batch["actions"].shape == (4, c.action_horizon, c.max_action_dim)
  assert not (batch["vl_tokens"] == c.image_token_id).any()
  first = batch["vl_tokens"][groot_inputs.sample_rows(batch)[0]]
  assert b"task " in bytes(int(t) for t in first if t < 256)
