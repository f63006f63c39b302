"""The same example samples in three batch layouts, for a packed-vs-padded train-step comparison.

  configured: the model config's packed row (an auto row: the example batch's plan for this many samples);
  padded:     one sample a row, every row the longest sample's length rounded up to ROW_MULTIPLE;
  best_fit:   the row ejax.data.row_plan chooses for exactly these samples (packed best-fit);
  seed_padded: one sample a row of the fixed shape the seed and openpi pad to (every camera slot's
              image tokens and the prompt padded to 200 tokens: GR00T 456, pi0.5 968 at full size).

Each arm carries its batch (numpy, as `example_batch` returns it), its token counts and the analytic
train-step FLOPs of the batch (ejax.train.flops, remat included: what the devices run), so that a
benchmark prints the FLOP ratio between two arms as the bound of their step-time ratio.

  arms = train_step_arms(groot.model_config("full"), 32)
  arms.flop_bound("padded", "best_fit")   # padded FLOPs / best-fit FLOPs
"""

from __future__ import annotations

import copy
import dataclasses
import importlib

import numpy as np

from ejax.data import row_plan
from ejax.train.flops import layout_of_batch, train_flops_per_sample, weight_shapes

# model name -> its input-assembly module (example_batch(..., pack=), example_lengths, example_config)
_INPUTS = {"groot": "ejax.models.groot_inputs", "pi05": "ejax.models.pi05_inputs"}
_STREAM = {"groot": "vl_segment_ids", "pi05": "prefix_segment_ids"}
SEED_PROMPT_PAD = 200  # the seed pads GR00T's instruction to 200 tokens; openpi's pi0.5 max_token_len


def seed_padded_length(model_config) -> int:
  """Tokens of the seed's fixed-shape row: every camera slot's image tokens, the prompt padded."""
  inputs = _inputs(model_config)
  if model_config.name == "groot":
    return model_config.num_cameras * inputs.tokens_per_image(model_config) + SEED_PROMPT_PAD
  return model_config.num_cameras * inputs.patches_per_image(model_config) + int(model_config.max_token_len)


@dataclasses.dataclass
class Arm:
  name: str
  batch: dict[str, np.ndarray]
  row_length: int
  samples_per_row: int
  num_rows: int
  real_tokens: int          # the samples' own tokens (the VL / prefix stream)
  row_tokens: int           # num_rows * row_length: what the packed transformers compute on
  padding_fraction: float
  flops: float | None       # analytic train-step FLOPs of the whole batch (None: not counted)


@dataclasses.dataclass
class LayoutArms:
  model_config: object       # as given (an auto row unresolved)
  num_samples: int
  lengths: np.ndarray        # the samples' stream lengths, in sample order
  arms: dict[str, Arm]

  def __getitem__(self, name: str) -> Arm:
    return self.arms[name]

  def flop_bound(self, slower: str = "padded", faster: str = "best_fit") -> float:
    """FLOPs of `slower`'s batch over `faster`'s: the step-time ratio at equal FLOP rates."""
    if self.arms[slower].flops is None or self.arms[faster].flops is None:
      raise ValueError("these arms were built with flops=False: build them with flops=True for a FLOP bound")
    return self.arms[slower].flops / self.arms[faster].flops

  def token_ratio(self, slower: str = "padded", faster: str = "best_fit") -> float:
    return self.arms[slower].row_tokens / self.arms[faster].row_tokens

  def describe(self) -> str:
    lines = [f"{self.num_samples} samples, {self.lengths.min()}..{self.lengths.max()} tokens "
             f"(mean {self.lengths.mean():.0f})"]
    for arm in self.arms.values():
      flops = f", {arm.flops / 1e12:.1f} TFLOP a step" if arm.flops is not None else ""
      lines.append(f"  {arm.name}: {arm.num_rows} rows x {arm.row_length} tokens ({arm.samples_per_row} a row), "
                   f"{arm.row_tokens} tokens, {arm.padding_fraction:.1%} padding{flops}")
    return "\n".join(lines)


def _inputs(model_config):
  if model_config.name not in _INPUTS:
    raise ValueError(f"model {model_config.name!r} has no packed rows: train_step_arms takes one of "
                     f"{', '.join(_INPUTS)}")
  return importlib.import_module(_INPUTS[model_config.name])


def _with_row(model_config, row_length: int, samples_per_row: int):
  config = copy.deepcopy(model_config)
  config.packing.row_length, config.packing.samples_per_row = int(row_length), int(samples_per_row)
  return config


def _arm(name: str, model_config, batch: dict, weights) -> Arm:
  segments = np.asarray(batch[_STREAM[model_config.name]])
  real = int(np.count_nonzero(segments))
  flops = None
  if weights is not None:
    samples = batch["actions"].shape[0]
    flops = train_flops_per_sample(model_config, layout_of_batch(model_config, batch), weights).hardware * samples
  return Arm(name, batch, int(segments.shape[1]), int(model_config.packing.samples_per_row), int(segments.shape[0]),
             real, int(segments.size), 1.0 - real / segments.size, flops)


def train_step_arms(model_config, num_samples: int, seed: int = 0, *, flops: bool = True) -> LayoutArms:
  """The configured, padded, best-fit and seed-padded layouts of `example_batch(model_config, num_samples, seed)`.

  flops=False skips the analytic FLOP count (it builds the model's shapes: seconds at full size).
  """
  if num_samples <= 0:
    raise ValueError(f"train_step_arms needs at least one sample, got num_samples={num_samples}")
  inputs = _inputs(model_config)
  lengths = np.asarray(inputs.example_lengths(model_config, num_samples, seed))
  configured = inputs.example_config(model_config, num_samples)  # an auto row: as one device's batch plans it
  padded = _with_row(model_config, row_plan.round_up(int(lengths.max()), row_plan.ROW_MULTIPLE), 1)
  max_row_length = row_plan.packing_options(model_config.packing)["max_row_length"]
  plan = row_plan.choose_row_plan(lengths, samples_per_batch=num_samples, max_row_length=max_row_length)
  best_fit = row_plan.with_plan(model_config, plan)
  weights = None
  if flops:
    weights = weight_shapes(configured)
  arms = {}
  seed_padded = _with_row(model_config, max(seed_padded_length(model_config), int(lengths.max())), 1)
  layouts = (("configured", configured, True), ("padded", padded, False), ("best_fit", best_fit, True),
             ("seed_padded", seed_padded, False))
  for name, config, pack in layouts:
    arms[name] = _arm(name, config, inputs.example_batch(config, num_samples, seed, pack=pack), weights)
  for arm in arms.values():  # the same samples in every layout
    if arm.real_tokens != int(lengths.sum()):
      raise AssertionError(f"the {arm.name} layout holds {arm.real_tokens} tokens, the samples {int(lengths.sum())}")
  return LayoutArms(model_config, num_samples, lengths, arms)
