"""Packing: every sample once, rows within length, segment ids / positions right, low padding."""

import grain
import numpy as np
import pytest

from ejax.data import packing


def test_pack_sequences_places_every_sample_once_within_rows():
  lengths = packing.vla_length_mix(2048, seed=3)
  rows = packing.pack_sequences(lengths, 1024, seed=7)
  flat = sorted(i for row in rows for i in row)
  assert flat == list(range(len(lengths)))
  assert max(sum(lengths[i] for i in row) for row in rows) <= 1024
  assert rows == packing.pack_sequences(lengths, 1024, seed=7)
  assert rows != packing.pack_sequences(lengths, 1024, seed=8)


def test_padding_fraction_on_the_benchmark_length_mix_is_below_3_percent():
  lengths = packing.vla_length_mix(4096, seed=0)
  for row_length in (1024, 2048):
    rows = packing.pack_sequences(lengths, row_length)
    padding = 1.0 - lengths.sum() / (len(rows) * row_length)
    assert padding < 0.03, (row_length, padding)


def test_too_long_sample_is_a_clear_error():
  with pytest.raises(ValueError, match=r"sample 2 has length 300 > row_length 256"):
    packing.pack_sequences([10, 20, 300], 256)


def _samples(lengths):
  return [{"tokens": np.arange(n, dtype=np.int32) + 1000 * i,
           "embeddings": np.full((n, 2), i, np.float32)} for i, n in enumerate(lengths)]


def test_pack_arrays_segment_ids_positions_and_metadata():
  lengths = [5, 3, 7, 2, 6, 1]
  samples = _samples(lengths)
  packed = packing.pack_arrays(samples, 8, buffer_size=4, seed=1)
  assert packed.arrays["tokens"].shape[1:] == (8,)
  assert packed.arrays["embeddings"].shape[1:] == (8, 2)
  assert sorted(packed.segments["sample_index"].tolist()) == list(range(6))
  for sample, row, offset, length in zip(*(packed.segments[k] for k in
                                           ("sample_index", "row", "offset", "length"))):
    assert length == lengths[sample]
    np.testing.assert_array_equal(packed.arrays["tokens"][row, offset:offset + length],
                                  samples[sample]["tokens"])
    np.testing.assert_array_equal(packed.positions[row, offset:offset + length], np.arange(length))
    ids = packed.segment_ids[row, offset:offset + length]
    assert len(set(ids.tolist())) == 1 and ids[0] >= 1
  # Segment ids run 1..n inside each row; padding is 0.
  for row in range(packed.segment_ids.shape[0]):
    ids = packed.segment_ids[row]
    used = ids[ids > 0]
    assert sorted(set(used.tolist())) == list(range(1, len(set(used.tolist())) + 1))
    assert np.all(ids[len(used):] == 0)
  total = packed.segment_ids.size
  assert packed.padding_fraction == pytest.approx(1 - sum(lengths) / total)


def test_pack_stream_matches_pack_arrays_rows():
  lengths = [int(x) for x in packing.vla_length_mix(40, seed=2)]
  batches = list(packing.pack_stream(iter(_samples(lengths)), 1024, rows_per_batch=3,
                                     buffer_size=16))
  seen = np.concatenate([b.segments["sample_index"] for b in batches])
  assert sorted(seen.tolist()) == list(range(40))
  for batch in batches:
    for sample, row, offset, length in zip(*(batch.segments[k] for k in
                                             ("sample_index", "row", "offset", "length"))):
      assert batch.arrays["tokens"][row, offset] == 1000 * sample


def test_grain_pack_iter_dataset_resumes_exactly():
  lengths = [int(x) for x in packing.vla_length_mix(50, seed=5)]
  source = grain.MapDataset.source(_samples(lengths)).to_iter_dataset()
  dataset = packing.PackIterDataset(source, 1024, buffer_size=16, seed=3, max_segments=16)
  rows = list(dataset)
  indices = np.concatenate([r["segment_sample_index"][:r["num_segments"]] for r in rows])
  assert sorted(indices.tolist()) == list(range(50))
  for row in rows:
    assert row["num_tokens"] == np.count_nonzero(row["segment_ids"])
  for stop in (1, 4, len(rows) - 1):
    iterator = iter(dataset)
    for _ in range(stop):
      next(iterator)
    state = iterator.get_state()
    resumed = iter(dataset)
    resumed.set_state(state)
    for expected in rows[stop:]:
      got = next(resumed)
      np.testing.assert_array_equal(got["tokens"], expected["tokens"])
      np.testing.assert_array_equal(got["segment_ids"], expected["segment_ids"])
