"""Choosing the packed row from the samples' lengths (ejax.data.row_plan), and what it gives the
full-size GR00T and pi0.5 configs on their example batches and on a LIBERO-like mix."""

import math

import numpy as np
import pytest

from ejax.data import row_plan
from ejax.data.packing import pack_sequences
from ejax.models import groot, groot_inputs, pi05, pi05_inputs
from ejax.train.layout_arms import train_step_arms

PER_DEVICE = 32  # configs/groot.py and pi05.py: batch 256 on a node of 8 GPUs


def test_plan_holds_samples_per_row_of_the_longest_in_whole_tiles():
  lengths = np.random.default_rng(0).integers(261, 270, 1000)
  plan = row_plan.choose_row_plan(lengths)
  assert plan.row_length % row_plan.ROW_MULTIPLE == 0
  assert plan.samples_per_row * plan.longest <= plan.row_length < plan.samples_per_row * plan.longest + 128
  assert plan.padding_fraction == pytest.approx(1 - plan.samples_per_row * lengths.mean() / plan.row_length)
  # A per-device batch of 32 rules out counts that leave slots empty (9 a row: 4 rows of 36 slots).
  per_device = row_plan.choose_row_plan(lengths, samples_per_batch=PER_DEVICE)
  assert PER_DEVICE % per_device.samples_per_row == 0
  assert per_device.padding_fraction < 0.03


@pytest.mark.parametrize("seed", range(5))
def test_every_batch_of_samples_no_longer_than_the_longest_fits_its_rows(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(40, 400, 300)
  batch = int(rng.integers(5, 40))
  plan = row_plan.choose_row_plan(lengths, samples_per_batch=batch)
  rows = math.ceil(batch / plan.samples_per_row)
  for trial in range(200):
    sample = rng.choice(lengths, batch)
    if trial == 0:
      sample[:] = plan.longest  # the worst case
    assert len(pack_sequences(sample, plan.row_length, buffer_size=batch)) <= rows


def test_a_fixed_count_and_the_cap_are_honoured():
  lengths = [500, 520, 610]
  assert row_plan.choose_row_plan(lengths, samples_per_row=3).row_length == 1920
  assert row_plan.choose_row_plan(lengths, max_row_length=1280).row_length <= 1280


@pytest.mark.parametrize("lengths, kwargs, message", [
    ([], {}, "non-empty list of sample lengths"),
    ([10, 0, 5], {}, "positive integers"),
    ([5000], {}, r"longest sample has 5000 tokens, more than a row of at most 4096: raise config.model.packing"),
    ([600], dict(samples_per_row=7), "7 samples of up to 600 tokens do not fit a row of at most 4096"),
    ([60], dict(samples_per_batch=0), "samples_per_batch must be positive"),
])
def test_bad_input_is_one_clear_line(lengths, kwargs, message):
  with pytest.raises(ValueError, match=message) as error:
    row_plan.choose_row_plan(lengths, **kwargs)
  assert "\n" not in str(error.value)


MODELS = {"groot": (groot, groot_inputs), "pi05": (pi05, pi05_inputs)}


@pytest.mark.parametrize("name", MODELS)
def test_full_size_rows_carry_at_most_10_percent_padding(name):
  model, inputs = MODELS[name]
  config = model.model_config("full")
  assert row_plan.is_auto(config.packing)
  # Example batches (the compile paths' and benchmarks'), a device's 32 samples and more. (pi0.5 pads
  # 8.5 % on average, one sample a row of 640; a batch of 8 short ones can reach 10 %.)
  resolved = inputs.example_config(config)
  for size, seed in ((PER_DEVICE, 0), (PER_DEVICE, 1), (64, 2)):
    batch = inputs.example_batch(config, size, seed)
    segments = batch["vl_segment_ids" if name == "groot" else "prefix_segment_ids"]
    assert segments.shape == (math.ceil(size / resolved.packing.samples_per_row), resolved.packing.row_length)
    assert 1 - np.count_nonzero(segments) / segments.size <= 0.10, (size, seed)
  # A LIBERO-like mix, as the train job would choose for it with a device's 32 samples a batch.
  lengths = inputs.libero_like_lengths(config, 2048, seed=0)
  plan = row_plan.choose_row_plan(lengths[:row_plan.PROBE_SAMPLES], samples_per_batch=PER_DEVICE)
  rows = math.ceil(PER_DEVICE / plan.samples_per_row)
  padding = []
  for start in range(0, len(lengths), PER_DEVICE):
    batch = lengths[start:start + PER_DEVICE]
    assert len(pack_sequences(batch, plan.row_length, buffer_size=PER_DEVICE)) <= rows
    padding.append(1 - batch.sum() / (rows * plan.row_length))
  assert np.mean(padding) <= 0.10 and plan.padding_fraction <= 0.10, (plan.describe(), np.mean(padding))


def test_the_fixed_rows_they_replace_padded_four_tenths():
  # Before: GR00T two a row of 1,024; pi0.5 two a row of 2,048.
  for (model, inputs), (row, per_row) in zip(MODELS.values(), ((1024, 2), (2048, 2))):
    config = model.model_config("full")
    config.packing.update(row_length=row, samples_per_row=per_row)
    lengths = inputs.libero_like_lengths(config, 2048)
    assert row_plan.batch_padding(lengths.mean(), row, per_row) > 0.4


def test_train_step_arms_hold_the_same_samples_in_each_layout():
  arms = train_step_arms(groot.model_config("full"), 16, seed=3, flops=False)
  assert set(arms.arms) == {"configured", "padded", "best_fit", "seed_padded"}
  padded = arms["padded"]
  assert padded.num_rows == 16 and padded.samples_per_row == 1 and padded.row_length == 384
  assert arms["best_fit"].padding_fraction <= 0.10 < padded.padding_fraction
  assert arms["seed_padded"].row_length == 456  # one camera's 256 tokens and the instruction padded to 200
  assert arms.token_ratio("padded", "best_fit") == pytest.approx(padded.row_tokens / arms["best_fit"].row_tokens)
  with pytest.raises(ValueError, match="flops=True"):
    arms.flop_bound()


def test_the_train_job_chooses_an_auto_row_from_the_dataset(tmp_path):
  from ejax.data.lerobot_writer import LeRobotV3Writer
  from ejax.models.qwen_tokenizer import load_tokenizer
  from ejax.train import inputs
  from tests.data.builders import TASKS, make_episodes, write_dataset
  from tests.train.helpers import load_config

  root = write_dataset(tmp_path / "dataset", LeRobotV3Writer, make_episodes())
  config = load_config("configs/groot.py", f"runlocal,dataset={root}")
  config.model.packing.update(row_length=0, samples_per_row=0)
  # The lengths are the collate's own: two cameras' image tokens and each task's byte-level prompt.
  tokenizer = load_tokenizer("", config.model.llm.vocab_size)
  prompts = {len(groot_inputs.prompt_ids(config.model, tokenizer, task, 2)) for task in TASKS}
  lengths = inputs.dataset_lengths(config, 64)
  assert set(lengths.tolist()) == prompts
  # Two devices of a process's 8 samples: a plan for batches of 4, the same on every process.
  resolved = inputs.with_packing_plan(config, local_batch_size=8, shards=2)
  plan = row_plan.choose_row_plan(inputs.dataset_lengths(config, row_plan.PROBE_SAMPLES), samples_per_batch=4)
  packing = resolved.model.packing
  assert (packing.row_length, packing.samples_per_row) == (plan.row_length, plan.samples_per_row)
  assert plan.longest == max(prompts) and config.model.packing.row_length == 0  # the caller's config as it was
  with inputs.make_input(resolved, local_batch_size=8, shards=2) as data:
    batch = next(data)
  assert batch["vl_tokens"].shape == (2 * math.ceil(4 / plan.samples_per_row), plan.row_length)
  # A config with its row set is returned as it is.
  assert inputs.with_packing_plan(resolved, local_batch_size=8, shards=2) is resolved
