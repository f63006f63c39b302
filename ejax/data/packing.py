"""Packing variable-length samples into fixed-length rows (segment ids, positions, metadata).

Padding every sample to the longest one wastes most of an attention batch (the seed padded short
instructions to 200 tokens). Instead, samples are packed into rows of `row_length` tokens:

  segment_ids [rows, row_length] int32: 1..n for the n samples of a row, 0 for padding;
  positions   [rows, row_length] int32: 0..len-1 inside each sample, 0 in padding;

so attention (`ejax.kernels.attention`) masks across samples and losses stay per sample.

The packer is round-based best-fit decreasing over a bounded buffer: it takes `buffer_size`
samples, sorts them longest first, puts each into the open row with the least room that still
fits it (a new row when none does), and emits that round's rows shuffled by `seed`. Rounds keep
memory bounded, make the result a pure function of (lengths, seed), and let the streaming form
checkpoint exactly: its state is its parent's state at the start of the round plus how many of
the round's rows were already emitted, so a restore re-reads and re-packs the same round.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ejax.errors import BatchError

DEFAULT_BUFFER_SIZE = 512  # samples per round: ~2 % padding on `vla_length_mix` in 1024-token rows


def _pack_round(lengths: Sequence[int], row_length: int) -> list[list[int]]:
  """Best-fit decreasing of one round; returns rows of positions into `lengths`."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  rows: list[list[int]] = []
  # Open rows sorted by remaining room: (room, row_number). Full rows leave the list.
  open_rooms: list[tuple[int, int]] = []
  for i in order:
    length = lengths[i]
    slot = bisect.bisect_left(open_rooms, (length, -1))
    if slot < len(open_rooms):
      room, row = open_rooms.pop(slot)
      rows[row].append(i)
      room -= length
    else:
      row = len(rows)
      rows.append([i])
      room = row_length - length
    if room > 0:
      bisect.insort(open_rooms, (room, row))
  return rows


def _check_lengths(lengths: Sequence[int], row_length: int, first_index: int = 0) -> None:
  if row_length <= 0:
    raise ValueError(f"row_length must be positive, got {row_length}")
  for offset, length in enumerate(lengths):
    if length > row_length:
      raise BatchError(
          f"sample {first_index + offset} has length {length} > row_length {row_length}: raise "
          f"row_length (config.model.packing.row_length) or truncate the sample before packing")
    if length <= 0:
      raise ValueError(f"sample {first_index + offset} has length {length}; lengths must be >= 1")


def pack_sequences(
    lengths: Sequence[int], row_length: int, *, buffer_size: int = DEFAULT_BUFFER_SIZE,
    seed: int = 0,
) -> list[list[int]]:
  """Packs samples of the given lengths into rows of at most `row_length`.

  Returns rows as lists of sample indices (into `lengths`), each index exactly once, each row's
  total length <= row_length. Deterministic for (lengths, row_length, buffer_size, seed).
  """
  lengths = [int(x) for x in lengths]
  _check_lengths(lengths, row_length)
  if buffer_size <= 0:
    raise ValueError(f"buffer_size must be positive, got {buffer_size}")
  rng = np.random.default_rng(seed)
  packed: list[list[int]] = []
  for start in range(0, len(lengths), buffer_size):
    round_rows = _pack_round(lengths[start:start + buffer_size], row_length)
    # Sorting puts long samples in early rows; shuffle so row order says nothing about length.
    for r in rng.permutation(len(round_rows)):
      packed.append([start + i for i in round_rows[r]])
  return packed


@dataclasses.dataclass
class PackedRows:
  """Rows built by `pack_arrays`.

  arrays: key -> [num_rows, row_length, ...] (padding filled with `pad_value`).
  segment_ids, positions: [num_rows, row_length] int32.
  segments: per packed sample, arrays of [num_segments] int64: sample_index, row, offset, length.
  padding_fraction: padded tokens / all tokens.
  """
  arrays: dict[str, np.ndarray]
  segment_ids: np.ndarray
  positions: np.ndarray
  segments: dict[str, np.ndarray]
  padding_fraction: float

  def as_batch(self) -> dict[str, np.ndarray]:
    """Flat dict for the train step: arrays plus segment_ids, positions and segment metadata."""
    batch = dict(self.arrays)
    batch["segment_ids"] = self.segment_ids
    batch["positions"] = self.positions
    for name, values in self.segments.items():
      batch[f"segment_{name}"] = values
    return batch


def _sample_length(sample: Mapping[str, np.ndarray], sample_index: int) -> int:
  lengths = {key: np.shape(value)[0] for key, value in sample.items()}
  distinct = set(lengths.values())
  if len(distinct) != 1:
    raise ValueError(f"sample {sample_index}: arrays disagree on their leading length {lengths}; "
                     "every packed array must be [len, ...] with the same len")
  return distinct.pop()


def assemble_rows(
    samples: Sequence[Mapping[str, np.ndarray]], rows: Sequence[Sequence[int]], row_length: int,
    *, sample_indices: Sequence[int] | None = None, pad_value: float | Mapping[str, Any] = 0,
) -> PackedRows:
  """Copies samples into rows as laid out by a packer (`rows` holds positions into `samples`)."""
  if not samples:
    raise ValueError("assemble_rows needs at least one sample")
  lengths = [_sample_length(s, i) for i, s in enumerate(samples)]
  keys = list(samples[0].keys())
  num_rows = len(rows)
  arrays = {}
  for key in keys:
    first = np.asarray(samples[0][key])
    fill = pad_value[key] if isinstance(pad_value, Mapping) else pad_value
    arrays[key] = np.full((num_rows, row_length) + first.shape[1:], fill, dtype=first.dtype)
  segment_ids = np.zeros((num_rows, row_length), np.int32)
  positions = np.zeros((num_rows, row_length), np.int32)
  meta: dict[str, list[int]] = {"sample_index": [], "row": [], "offset": [], "length": []}
  for row, members in enumerate(rows):
    offset = 0
    for segment, i in enumerate(members, start=1):
      length = lengths[i]
      if offset + length > row_length:
        raise ValueError(f"row {row} overflows: {offset + length} tokens > row_length {row_length}")
      for key in keys:
        arrays[key][row, offset:offset + length] = samples[i][key]
      segment_ids[row, offset:offset + length] = segment
      positions[row, offset:offset + length] = np.arange(length, dtype=np.int32)
      meta["sample_index"].append(sample_indices[i] if sample_indices is not None else i)
      meta["row"].append(row)
      meta["offset"].append(offset)
      meta["length"].append(length)
      offset += length
  used = sum(lengths[i] for members in rows for i in members)
  padding_fraction = 1.0 - used / float(max(num_rows * row_length, 1))
  segments = {name: np.asarray(values, np.int64) for name, values in meta.items()}
  return PackedRows(arrays, segment_ids, positions, segments, padding_fraction)


def pack_arrays(
    samples: Sequence[Mapping[str, np.ndarray]], row_length: int, *,
    buffer_size: int = DEFAULT_BUFFER_SIZE, seed: int = 0,
    pad_value: float | Mapping[str, Any] = 0,
) -> PackedRows:
  """Packs per-sample arrays (dicts of [len, ...] arrays sharing len) into fixed-length rows."""
  lengths = [_sample_length(s, i) for i, s in enumerate(samples)]
  rows = pack_sequences(lengths, row_length, buffer_size=buffer_size, seed=seed)
  return assemble_rows(samples, rows, row_length, pad_value=pad_value)


def _length_of_first_array(sample: Mapping[str, np.ndarray]) -> int:
  return int(np.shape(next(iter(sample.values())))[0])


def pack_stream(
    samples: Iterator[Mapping[str, np.ndarray]], row_length: int, *, rows_per_batch: int,
    buffer_size: int = DEFAULT_BUFFER_SIZE, seed: int = 0,
) -> Iterator[PackedRows]:
  """Plain-iterator form: packs rounds of `buffer_size` samples and yields `rows_per_batch` rows.

  Rows left over at the end of a round carry into the next batch; a final short batch is yielded.
  """
  packer = _RoundPacker(row_length, buffer_size, seed)
  pending: list[tuple[list[Mapping[str, np.ndarray]], list[int]]] = []
  for row in packer.rows(samples):
    pending.append(row)
    if len(pending) == rows_per_batch:
      yield _assemble_pending(pending, row_length)
      pending = []
  if pending:
    yield _assemble_pending(pending, row_length)


def _assemble_pending(pending, row_length: int) -> PackedRows:
  samples = [s for members, _ in pending for s in members]
  indices = [i for _, ids in pending for i in ids]
  rows, start = [], 0
  for members, _ in pending:
    rows.append(list(range(start, start + len(members))))
    start += len(members)
  return assemble_rows(samples, rows, row_length, sample_indices=indices)


class _RoundPacker:
  """Round-based packing shared by the plain-iterator and the grain forms."""

  def __init__(self, row_length: int, buffer_size: int, seed: int):
    self.row_length, self.buffer_size, self.seed = row_length, buffer_size, seed

  def pack(self, round_samples: Sequence[Mapping[str, np.ndarray]], round_number: int,
           length_fn: Callable[[Mapping[str, np.ndarray]], int], first_index: int,
           ) -> list[list[int]]:
    lengths = [length_fn(s) for s in round_samples]
    _check_lengths(lengths, self.row_length, first_index)
    rows = _pack_round(lengths, self.row_length)
    order = np.random.default_rng((self.seed, round_number)).permutation(len(rows))
    return [rows[r] for r in order]

  def rows(self, samples: Iterator[Mapping[str, np.ndarray]],
           length_fn: Callable = _length_of_first_array):
    round_number, seen = 0, 0
    samples = iter(samples)
    while True:
      round_samples = []
      for sample in samples:
        round_samples.append(sample)
        if len(round_samples) == self.buffer_size:
          break
      if not round_samples:
        return
      for members in self.pack(round_samples, round_number, length_fn, seen):
        yield [round_samples[i] for i in members], [seen + i for i in members]
      seen += len(round_samples)
      round_number += 1


def _row_element(members: Sequence[Mapping[str, np.ndarray]], indices: Sequence[int],
                 row_length: int, max_segments: int) -> dict[str, np.ndarray]:
  """One packed row as a flat dict of fixed shapes, so grain can batch rows by stacking."""
  if len(members) > max_segments:
    raise ValueError(f"a row holds {len(members)} samples > max_segments {max_segments}: raise "
                     "max_segments (data.packing.max_segments) or lower the buffer size")
  packed = assemble_rows(members, [list(range(len(members)))], row_length, sample_indices=indices)
  row = {key: value[0] for key, value in packed.arrays.items()}
  row["segment_ids"] = packed.segment_ids[0]
  row["positions"] = packed.positions[0]
  for name, values in packed.segments.items():
    if name == "row":
      continue
    padded = np.full((max_segments,), -1 if name == "sample_index" else 0, np.int64)
    padded[:len(values)] = values
    row[f"segment_{name}"] = padded
  row["num_segments"] = np.int32(len(members))
  row["num_tokens"] = np.int32(sum(packed.segments["length"]))
  return row


class PackIterDataset:
  """Grain form: `PackIterDataset(parent, row_length)` is an IterDataset of packed rows.

  Each element: every token array of the samples laid out as [row_length, ...], `segment_ids`,
  `positions`, `segment_sample_index` / `segment_offset` / `segment_length` [max_segments] (-1 /
  0 padding), `num_segments`, `num_tokens`. A sample's arrays must all be [len, ...]; `sample_index`
  counts samples in stream order from 0. Checkpointable: see the module docstring.
  """

  def __new__(cls, parent, row_length: int, *, buffer_size: int = DEFAULT_BUFFER_SIZE,
              seed: int = 0, max_segments: int = 64,
              length_fn: Callable[[Mapping[str, np.ndarray]], int] = _length_of_first_array):
    import grain  # Lazy: packing itself needs only numpy.

    class _Iterator(grain.DatasetIterator):

      def __init__(self, parent_iter):
        super().__init__(parent_iter)
        self._packer = _RoundPacker(row_length, buffer_size, seed)
        self._round, self._seen, self._emitted = 0, 0, 0
        self._round_start_state = parent_iter.get_state()
        self._rows: list[tuple[list, list[int]]] = []

      def _load_round(self) -> None:
        self._round_start_state = self._parent.get_state()
        samples = []
        for sample in self._parent:
          samples.append(sample)
          if len(samples) == buffer_size:
            break
        if not samples:
          raise StopIteration
        rows = self._packer.pack(samples, self._round, length_fn, self._seen)
        self._rows = [([samples[i] for i in r], [self._seen + i for i in r]) for r in rows]
        self._round_size = len(samples)
        self._emitted = 0

      def __next__(self):
        if self._emitted == len(self._rows):
          if self._rows:
            self._seen += self._round_size
            self._round += 1
          self._load_round()
        members, indices = self._rows[self._emitted]
        self._emitted += 1
        return _row_element(members, indices, row_length, max_segments)

      def get_state(self):
        # A finished round is stored as "start of the next one" so restore needs no re-read.
        if self._rows and self._emitted == len(self._rows):
          return {"parent": self._parent.get_state(), "round": self._round + 1,
                  "seen": self._seen + self._round_size, "emitted": 0}
        return {"parent": self._round_start_state, "round": self._round, "seen": self._seen,
                "emitted": self._emitted}

      def set_state(self, state):
        self._parent.set_state(state["parent"])
        self._round, self._seen = int(state["round"]), int(state["seen"])
        self._rows, self._emitted = [], 0
        emitted = int(state["emitted"])
        if emitted:
          self._load_round()
          self._emitted = emitted

    class _Dataset(grain.IterDataset):

      def __iter__(self):
        return _Iterator(self._parent.__iter__())

    return _Dataset(parent)


def vla_length_mix(num_samples: int, seed: int = 0) -> np.ndarray:
  """Token lengths of a typical VLA mix, used by the packing test and benchmarks/data.py.

  GR00T-style vision-language prefixes: 1-3 cameras x 64 image tokens (Eagle's pixel shuffle turns
  a 224 px SigLIP image into 64 tokens), an 8-96 token instruction, 1 state token and 16 action
  tokens: lengths 89..305. Packed into rows of 1024 or 2048 tokens.
  """
  rng = np.random.default_rng(seed)
  cameras = rng.integers(1, 4, num_samples)
  instruction = rng.integers(8, 97, num_samples)
  return cameras * 64 + instruction + 1 + 16


def collate_per_shard(collate: Callable[[list], dict], shards: int) -> Callable[[list], dict]:
  """`collate` applied to each of `shards` equal runs of a batch's samples, the results concatenated.

  The trainer splits each process's batch over its devices (the ACT_BATCH mesh axes): packed per
  device, every sample's rows and image slots lie on the sample's own device, so the model indexes
  them locally (ejax.parallel.shard_local) instead of gathering the global batch onto each device.
  Model collates write sample -> row indices relative to each sample's home row, so concatenated
  batches stay valid (as processes' batches do in a multi-host global batch).
  """
  if shards <= 1:
    return collate

  def per_shard(samples: list) -> dict:
    if len(samples) % shards:
      raise BatchError(f"a batch of {len(samples)} samples does not split over the {shards} devices that "
                       f"hold this process's share: make the batch a multiple of {shards}")
    size = len(samples) // shards
    return concatenate_batches([collate(samples[i * size:(i + 1) * size]) for i in range(shards)])

  return per_shard


def concatenate_batches(parts: Sequence[Mapping[str, Any]]) -> dict:
  """Batches joined along their leading axis (arrays and lists; other values from the first)."""
  out = {}
  for key, value in parts[0].items():
    if isinstance(value, np.ndarray) and value.ndim:
      out[key] = np.concatenate([part[key] for part in parts])
    elif isinstance(value, list):
      out[key] = [item for part in parts for item in part[key]]
    else:
      out[key] = value
  return out
