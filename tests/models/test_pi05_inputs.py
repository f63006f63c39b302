"""pi0.5 input assembly (tokenizer, prompt, collate) and the runlocal model learning on a small dataset."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ejax.errors import BatchError
from ejax.models import layers, pi05, pi05_inputs
from ejax.models.paligemma_tokenizer import PaligemmaTokenizer, build_tokenizer, discretize_state, pi05_prompt

TASKS = ["pick up the red block", "open the top drawer", "put the bowl on the plate", "push the cylinder left"]
STATE_DIM, ACTION_DIM, NUM_CAMERAS = 3, 3, 2


@pytest.fixture(scope="module")
def config():
  c = pi05.model_config("runlocal")
  c.action_horizon = 4
  return c


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  """A small sentencepiece model trained on pi0.5 prompts (the released one is not downloadable here)."""
  path = tmp_path_factory.mktemp("tokenizer") / "paligemma_tokenizer.model"
  build_tokenizer(str(path), TASKS, state_dim=4)
  return PaligemmaTokenizer(str(path), max_len=64)


class SmallDemos:
  """Pipeline-schema samples whose actions follow state and task (learnable), with per-task
  camera colours, an absent second camera on some samples, padded steps and 3 of 4 action dims."""

  def __init__(self, horizon: int, seed: int = 0):
    world = np.random.default_rng(seed)
    self.horizon = horizon
    self.maps = world.normal(size=(len(TASKS), STATE_DIM, ACTION_DIM)) / np.sqrt(STATE_DIM)
    self.colours = world.integers(0, 256, (len(TASKS), 3))

  def sample(self, index: int) -> dict:
    rng = np.random.default_rng([1, index])
    task = int(rng.integers(len(TASKS)))
    state = rng.uniform(-1, 1, STATE_DIM).astype(np.float32)
    phase = np.linspace(0, 1, self.horizon)[:, None]
    action = (np.tanh(state @ self.maps[task])[None] * (1 - phase)).astype(np.float32)
    image = np.clip(self.colours[task] + rng.normal(0, 10, (40, 30, 3)), 0, 255).astype(np.uint8)
    sample = {"observation.state": state, "observation.images.base": image, "action": action,
              "action_is_pad": np.arange(self.horizon) >= self.horizon - int(rng.integers(0, 2)),
              "task": TASKS[task]}
    if index % 3:
      sample["observation.images.wrist"] = image[::-1]
    return sample


def test_prompt_format_and_state_bins(tokenizer):
  assert list(discretize_state(np.array([-1.0, -0.999, 0.0, 0.999, 1.0, 3.0]))) == [0, 0, 128, 255, 255, 255]
  prompt = pi05_prompt("pick_up the\nblock ", np.array([-1.0, 0.0, 1.0]))
  assert prompt == "Task: pick up the block, State: 0 128 255;\nAction: "
  ids = tokenizer.tokenize_prompt("pick up the red block", np.zeros(3))
  assert ids[0] == 2 and tokenizer.decode(ids[1:]).startswith("Task: pick up the red block, State: 128 128 128;")
  with pytest.raises(ValueError, match="max_len"):
    tokenizer.tokenize_prompt("pick up the red block " * 20, np.zeros(3))
  with pytest.raises(FileNotFoundError, match="tokenizer_path"):
    PaligemmaTokenizer("/nonexistent/paligemma_tokenizer.model")


def test_collate_packs_prompts_and_skips_absent_cameras(config, tokenizer):
  demos = SmallDemos(config.action_horizon)
  samples = [demos.sample(i) for i in range(6)]
  samples[0]["observation.images.wrist_mask"] = np.bool_(False)  # present in the dict, flagged absent
  samples[0]["observation.images.wrist"] = samples[0]["observation.images.base"]
  batch = pi05_inputs.collate(samples, config, tokenizer)
  per_image = pi05_inputs.patches_per_image(config)
  cameras = [len(pi05_inputs.present_cameras(s)) for s in samples]
  assert cameras == [1, 2, 2, 1, 2, 2]
  assert int(np.sum(batch["prefix_is_image"])) == sum(cameras) * per_image
  assert batch["prefix_tokens"].shape == (3, config.packing.row_length)
  for i, sample in enumerate(samples):
    row, slot = pi05_inputs.sample_rows(batch)[i], batch["sample_slot"][i]
    in_row = batch["prefix_segment_ids"][row] == slot + 1
    prompt = tokenizer.tokenize_prompt(sample["task"], np.pad(sample["observation.state"], (0, 1)))
    assert in_row.sum() == cameras[i] * per_image + len(prompt)
    text = batch["prefix_tokens"][row][in_row & ~batch["prefix_is_image"][row]]
    np.testing.assert_array_equal(text, prompt)
    chunk = batch["suffix_positions"][row, slot * config.action_horizon:(slot + 1) * config.action_horizon]
    np.testing.assert_array_equal(chunk, in_row.sum() + np.arange(config.action_horizon))
    real = ~sample["action_is_pad"]
    np.testing.assert_array_equal(batch["action_mask"][i, :, :ACTION_DIM], np.repeat(real[:, None], 3, 1))
    assert not batch["action_mask"][i, :, ACTION_DIM:].any()
  assert batch["images"].shape == (6 * config.packing.max_images_per_sample, 32, 32, 3)
  with pytest.raises(ValueError, match="action_horizon"):
    pi05_inputs.collate([{**samples[1], "action": np.zeros((9, 3), np.float32)}], config, tokenizer)


def test_a_policy_batch_takes_the_rows_it_needs_where_a_training_batch_stops(config, tokenizer):
  """A training batch has rows_for rows (a fixed shape every host agrees on) and one error line when
  its samples do not fit; a policy's batch (make_collate(..., fit_rows=True), the policy's inference
  collate) takes the rows it needs instead: the 15 suites' 60 eval prompts needed 13 rows of 240 where
  rows_for gave 12. Every sample still finds its own prompt in its row."""
  demos = SmallDemos(config.action_horizon)
  samples = [demos.sample(i) for i in range(6)]
  per_image = pi05_inputs.patches_per_image(config)
  lengths = [len(pi05_inputs.present_cameras(s)) * per_image
             + len(tokenizer.tokenize_prompt(s["task"], np.pad(s["observation.state"], (0, 1)))) for s in samples]
  narrow = config.copy_and_resolve_references()
  narrow.packing.row_length = max(lengths) + 1      # about one sample a row: 6 rows where rows_for gives 3
  assert pi05_inputs.rows_for(narrow, 6) == 3
  with pytest.raises(BatchError, match="6 samples need .* rows of .* but the batch has 3"):
    pi05_inputs.make_collate(narrow, tokenizer)(samples)
  batch = pi05_inputs.make_collate(narrow, tokenizer, fit_rows=True)(samples)
  assert batch["prefix_tokens"].shape[0] > 3
  for i, sample in enumerate(samples):
    row, slot = pi05_inputs.sample_rows(batch)[i], batch["sample_slot"][i]
    in_row = batch["prefix_segment_ids"][row] == slot + 1
    prompt = tokenizer.tokenize_prompt(sample["task"], np.pad(sample["observation.state"], (0, 1)))
    np.testing.assert_array_equal(batch["prefix_tokens"][row][in_row & ~batch["prefix_is_image"][row]], prompt)


def test_concatenated_local_batches_keep_rows_and_images_with_their_samples(config, tokenizer):
  # Multi-host: the global batch is the concatenation of process-local batches; indices are stored
  # relative to home rows/images, so every sample still finds its own prefix row and its own images.
  demos = SmallDemos(config.action_horizon)
  per_image = pi05_inputs.patches_per_image(config)
  local = []
  for process in range(2):
    samples = [demos.sample(100 * process + j) for j in range(5)]
    for j, sample in enumerate(samples):  # image pixels say which sample and camera they are
      for c, key in enumerate(pi05_inputs.present_cameras(sample)):
        sample[key] = np.full((32, 32, 3), 10 * (5 * process + j) + c + 1, np.uint8)
    local.append(pi05_inputs.collate(samples, config, tokenizer, seed=process))
  batch = {k: np.concatenate([b[k] for b in local]) for k in local[0]}
  rows = pi05_inputs.sample_rows(batch)
  index = pi05_inputs.image_token_indices(batch, per_image)
  for i in range(10):
    row, slot = rows[i], batch["sample_slot"][i]
    assert np.all(batch["suffix_segment_ids"][row, slot * config.action_horizon] == slot + 1)
    mine = (batch["prefix_segment_ids"][row] == slot + 1) & batch["prefix_is_image"][row]
    image_ids = np.unique(index[row][mine] // per_image)
    values = sorted(int(batch["images"][k][0, 0, 0]) for k in image_ids)
    assert values == [10 * i + c + 1 for c in range(len(values))] and values


@pytest.mark.timeout(600)
def test_runlocal_loss_falls_by_half_on_a_small_dataset(config, tokenizer):
  demos = SmallDemos(config.action_horizon)
  model = layers.host_random_init(nnx.eval_shape(lambda: pi05.create(config, nnx.Rngs(0))), seed=0, stddev=0.02)
  # Norm scales / adaRMS keep the published zero init (host_random_init fills weights only).
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, rng):
    def loss_fn(model):
      loss, _ = model.compute_loss(batch, rng)
      return loss
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  batch_size, steps = 8, 120
  losses = []
  keys = jax.random.split(jax.random.key(0, impl="rbg"), steps)
  for i in range(steps):
    samples = [demos.sample(i * batch_size + j) for j in range(batch_size)]
    batch = {k: jnp.asarray(v) for k, v in pi05_inputs.collate(samples, config, tokenizer, seed=i).items()}
    losses.append(float(step(model, optimizer, batch, keys[i])))
  start, end = np.mean(losses[:10]), np.mean(losses[-10:])
  assert end < 0.5 * start, (start, end)


def test_collate_with_perception_bins_only_the_datas_own_state(tokenizer):
  """With model.perception the state's last slots are the module's (zero in the data): the prompt bins the
  data's own entries only (26 bins for ejax.sim's 11-d state overflowed the runlocal prompt), and the batch
  carries the whole vector for the module."""
  from ejax.models import perception
  c = pi05.model_config("runlocal")
  c.action_horizon = 4
  c.perception = perception.default_config()
  c.perception.update(image_size=0)
  c.perception.estimate.update(dim=2, width=16)
  c.max_state_dim = STATE_DIM + perception.state_slots(c.perception, c.num_cameras)
  demos = SmallDemos(c.action_horizon)
  samples = [demos.sample(i) for i in (1, 2, 4, 5)]   # both cameras each: the hook reads every camera
  batch = pi05_inputs.collate(samples, c, tokenizer)
  assert batch["state"].shape == (4, c.max_state_dim)
  for i, sample in enumerate(samples):
    row, slot = pi05_inputs.sample_rows(batch)[i], batch["sample_slot"][i]
    in_row = batch["prefix_segment_ids"][row] == slot + 1
    text = batch["prefix_tokens"][row][in_row & ~batch["prefix_is_image"][row]]
    np.testing.assert_array_equal(text, tokenizer.tokenize_prompt(sample["task"], sample["observation.state"]))
    np.testing.assert_array_equal(batch["state"][i, :STATE_DIM], sample["observation.state"])
    assert not batch["state"][i, STATE_DIM:].any()


def test_collate_without_discrete_state_input_leaves_the_state_out_of_the_prompt(tokenizer):
  """model.discrete_state_input=False (openpi's pi05 switch): the prompt is the task alone, and with
  model.continuous_state the batch carries the state as a vector for the action expert."""
  c = pi05.model_config("runlocal")
  c.action_horizon = 4
  c.update(discrete_state_input=False, continuous_state=True)
  samples = [SmallDemos(c.action_horizon).sample(i) for i in range(4)]
  batch = pi05_inputs.collate(samples, c, tokenizer)
  for i, sample in enumerate(samples):
    row, slot = pi05_inputs.sample_rows(batch)[i], batch["sample_slot"][i]
    text = batch["prefix_tokens"][row][(batch["prefix_segment_ids"][row] == slot + 1) & ~batch["prefix_is_image"][row]]
    np.testing.assert_array_equal(text, tokenizer.tokenize_prompt(sample["task"], None))
    np.testing.assert_array_equal(batch["state"][i, :STATE_DIM], sample["observation.state"])
