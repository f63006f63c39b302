"""Choosing the packed row: tokens a row and samples a row, from the samples' lengths.

GR00T and pi0.5 lay each batch out in a fixed number of rows, ceil(samples / samples_per_row), of
`row_length` tokens (static shapes: one compile), and pack the samples' token streams into them
best-fit (ejax.data.packing). A row length and a sample count fixed in the config fit one dataset
and waste the next: two of GR00T's 261-269-token example samples in a 1,024-token row leave 48 % of
it padding. `model.packing.row_length = 0` ("auto") lets the run choose both at start-up instead:

  the train job from the lengths of the dataset's first `packing.probe_samples` samples (shuffled as
  the run will read them; ejax.train.inputs.with_packing_plan), every process from the same samples;
  the model's example batches, compile reports and benchmarks from the example batch's lengths
  (`resolve_for_examples`).

The plan: for each samples_per_row n, the shortest row, a multiple of ROW_MULTIPLE (attention tiles
are 128 tokens), that holds n samples of the longest length seen; of these, the one whose batches
carry the least padding (within PADDING_TOLERANCE of the least, the shortest row). Every batch of
samples no longer than that longest then fits its rows: best-fit opens a row only when every open
row already holds n samples (a row with fewer has room for one more). A later sample a little
longer still fits unless its batch has no slack, which the gap between the mean and the longest
length makes rare; if it does not, the collate stops with a one-line error naming the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

ROW_MULTIPLE = 128          # rows end on an attention tile boundary
MAX_ROW_LENGTH = 4096       # default cap on a chosen row (model.packing.max_row_length)
MAX_SAMPLES_PER_ROW = 64    # action-chunk slots a row may carry
PROBE_SAMPLES = 512         # dataset samples the train job measures (model.packing.probe_samples)
EXAMPLE_SAMPLES = 1024      # example-batch samples a plan for examples is chosen from
PADDING_TOLERANCE = 0.005   # a longer row must save more than this much padding to be chosen
# Samples a row for example batches: powers of two, so that the 8k-sample batches the compile paths
# build (ejax.train.compile_report.abstract_batch) and any power-of-two batch fill whole rows.
EXAMPLE_SAMPLES_PER_ROW = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class RowPlan:
  """A packed-row layout and what it costs on the lengths it was chosen from."""
  row_length: int
  samples_per_row: int
  padding_fraction: float       # padded tokens / row tokens, on batches of `samples_per_batch`
  samples_per_batch: int | None  # None: batches a whole number of rows long
  longest: int                  # the longest sample length every row holds samples_per_row of
  mean_length: float
  num_lengths: int

  def describe(self) -> str:
    batch = f"batches of {self.samples_per_batch}" if self.samples_per_batch else "whole rows"
    return (f"{self.samples_per_row} samples a row of {self.row_length} tokens: {self.padding_fraction:.1%} "
            f"padding on {batch} of {self.num_lengths} measured samples (mean {self.mean_length:.0f} tokens, "
            f"longest {self.longest})")


def is_auto(packing) -> bool:
  """Whether a model's packing config asks for the row to be chosen at start-up."""
  return int(packing.get("row_length", 0) or 0) == 0


def batch_padding(mean_length: float, row_length: int, samples_per_row: int,
                  samples_per_batch: int | None = None) -> float:
  """Padding of a batch of samples of this mean length laid out in ceil(batch / samples_per_row) rows."""
  samples = samples_per_batch or samples_per_row
  rows = math.ceil(samples / samples_per_row)
  return 1.0 - samples * mean_length / (rows * row_length)


def round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def _check_lengths(lengths: Sequence[int]) -> np.ndarray:
  values = np.asarray(lengths)
  if values.ndim != 1 or values.size == 0:
    raise ValueError("choose_row_plan needs a non-empty list of sample lengths")
  if not np.issubdtype(values.dtype, np.integer) or values.min() <= 0:
    raise ValueError(f"sample lengths must be positive integers, got {values[:8].tolist()}...")
  return values.astype(np.int64)


def choose_row_plan(lengths: Sequence[int], *, samples_per_batch: int | None = None,
                    samples_per_row: int | None = None, max_row_length: int = MAX_ROW_LENGTH,
                    multiple: int = ROW_MULTIPLE, max_samples_per_row: int = MAX_SAMPLES_PER_ROW,
                    allowed_samples_per_row: Sequence[int] | None = None) -> RowPlan:
  """The (row_length, samples_per_row) that pads batches of these lengths least (module docstring).

  samples_per_batch: the samples each collate packs (a device's share of the batch); None: batches
  a whole number of rows long. samples_per_row: fix the count and choose only the row length;
  allowed_samples_per_row: choose the count among these.
  """
  values = _check_lengths(lengths)
  if multiple <= 0 or max_row_length < multiple:
    raise ValueError(f"the row multiple ({multiple}) must be positive and at most max_row_length ({max_row_length})")
  if samples_per_batch is not None and samples_per_batch <= 0:
    raise ValueError(f"samples_per_batch must be positive, got {samples_per_batch}")
  longest, mean = int(values.max()), float(values.mean())
  if round_up(longest, multiple) > max_row_length:
    raise ValueError(f"the longest sample has {longest} tokens, more than a row of at most {max_row_length}: raise "
                     "config.model.packing.max_row_length, or shorten the samples (fewer cameras, a shorter prompt)")
  if samples_per_row is not None:
    counts = [int(samples_per_row)]
    if counts[0] <= 0 or round_up(counts[0] * longest, multiple) > max_row_length:
      raise ValueError(f"{samples_per_row} samples of up to {longest} tokens do not fit a row of at most "
                       f"{max_row_length} tokens: lower packing.samples_per_row or raise packing.max_row_length")
  else:
    most = min(max_row_length // longest, max_samples_per_row, samples_per_batch or max_samples_per_row)
    counts = [n for n in range(1, max(most, 1) + 1)
              if allowed_samples_per_row is None or n in allowed_samples_per_row]
  plans = []
  for count in counts:
    row_length = round_up(count * longest, multiple)
    padding = batch_padding(mean, row_length, count, samples_per_batch)
    plans.append(RowPlan(row_length, count, padding, samples_per_batch, longest, mean, int(values.size)))
  least = min(plan.padding_fraction for plan in plans)
  return min((p for p in plans if p.padding_fraction <= least + PADDING_TOLERANCE), key=lambda p: p.row_length)


def packing_options(packing) -> dict:
  """choose_row_plan's keyword arguments set in a model's packing config."""
  options = dict(max_row_length=int(packing.get("max_row_length", MAX_ROW_LENGTH) or MAX_ROW_LENGTH))
  if int(packing.get("samples_per_row", 0) or 0) > 0:
    options["samples_per_row"] = int(packing.samples_per_row)
  return options


def with_plan(model_config, plan: RowPlan):
  """A copy of model_config whose packing holds the plan's row length and samples per row."""
  resolved = copy.deepcopy(model_config)
  resolved.packing.row_length = plan.row_length
  resolved.packing.samples_per_row = plan.samples_per_row
  return resolved


def resolve(model_config, lengths: Sequence[int], *, samples_per_batch: int | None = None,
            allowed_samples_per_row: Sequence[int] | None = None):
  """(model_config with a concrete row, the RowPlan): unchanged, plan None, where the row is set."""
  if not is_auto(model_config.packing):
    return model_config, None
  plan = choose_row_plan(lengths, samples_per_batch=samples_per_batch, allowed_samples_per_row=allowed_samples_per_row,
                         **packing_options(model_config.packing))
  return with_plan(model_config, plan), plan


def resolve_for_examples(model_config, example_lengths: Callable[..., Sequence[int]],
                         samples_per_batch: int | None = None):
  """model_config with its row chosen from EXAMPLE_SAMPLES example-batch lengths (a fixed draw, so that
  example batches of every size and seed share one layout, EXAMPLE_SAMPLES_PER_ROW samples a row),
  for batches of `samples_per_batch` (a device's share, as the train job plans; None: whole rows);
  unchanged where the row is set."""
  if not is_auto(model_config.packing):
    return model_config
  lengths = example_lengths(model_config, EXAMPLE_SAMPLES, 0)
  return resolve(model_config, lengths, samples_per_batch=samples_per_batch,
                 allowed_samples_per_row=EXAMPLE_SAMPLES_PER_ROW)[0]
