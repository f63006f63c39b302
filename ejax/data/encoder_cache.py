"""Frozen-encoder outputs cached on disk (issue 32 point 3): written once by a model's encode job, read by
the trainer instead of the raw samples, verified so that a stale or damaged cache is one clear error.

A cache is a directory:
  manifest.json          what wrote it (below), written last
  shard_00000/<field>.npy  every per-sample field of shard 0 (leading axis: its samples), ...
  tables/<name>.npy, tables/<name>_offsets.npy  ragged tables (the prompts' text embeddings, each once)

The manifest records
  inputs       {dotted config path: value} of every setting the cached values depend on (the model's
               encoder settings, the data settings): the reader compares them with the run's config;
  frozen       the frozen parameters' components and fingerprint (`fingerprint`): the trainer compares
               it with its own frozen weights (`CachedBatches.check_frozen`), so a cache of other
               weights (another seed's random encoders at CPU size, other imported weights) is refused;
  fields       name -> dtype and per-sample shape; tables -> the per-sample index field, padded length;
  shards       each shard's sample count and, per file, its bytes and sha256 (checked when opened);
  norm_stats   the input pipeline's normalisation statistics (they travel into checkpoints);
  and how long encoding took.
A cache is written into DIR.partial-<pid> and renamed onto DIR when complete (an interrupted job leaves
no manifest at DIR); the reader refuses a directory without a manifest.

Model-agnostic: the model's encode job (ejax/models/dreamzero/encode.py) decides what the fields are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any, Iterable

import numpy as np

from ejax.data.errors import DataError

FORMAT = "ejax.encoder_cache/1"
MANIFEST = "manifest.json"
_CHUNK = 1 << 23
# numpy has no bfloat16 of its own: such arrays are stored as their uint16 bits, the manifest says so.
_STORED_AS = {"bfloat16": np.uint16}


class StaleCache(DataError):
  """The cache is missing, of another format, or was written for other settings or frozen weights: what
  rewriting it fixes (data.encoder_cache_refresh does that). A damaged file stays a plain DataError."""


def _logical_dtype(name: str):
  if name == "bfloat16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_CHUNK), b""):
      digest.update(block)
  return digest.hexdigest()


def _save(path: str, array: np.ndarray) -> dict:
  array = np.ascontiguousarray(array)
  stored = array.view(_STORED_AS[array.dtype.name]) if array.dtype.name in _STORED_AS else array
  with open(path, "wb") as f:
    np.save(f, stored, allow_pickle=False)
    f.flush()
    os.fsync(f.fileno())
  return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def jsonable(value: Any) -> Any:
  """Config values and statistics as plain JSON (tuples as lists, numpy as Python)."""
  return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def config_value(config, dotted: str) -> Any:
  """config's value at "a.b.c" as JSON, or None where the run's config has no such setting."""
  node = config
  for name in dotted.split("."):
    try:
      node = node[name]
    except (KeyError, TypeError, AttributeError):
      return None
  return jsonable(node.to_dict() if hasattr(node, "to_dict") else node)


# -- writing ------------------------------------------------------------------------------------------
class CacheWriter:
  """Per-sample batches in, shards out; `finish` writes the tables and manifest and publishes the cache."""

  def __init__(self, directory: str, *, shard_size: int = 1024):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    # finish() replaces the directory whole: never one that holds something else
    if os.path.isdir(self.directory) and os.listdir(self.directory) and not os.path.isfile(
        os.path.join(self.directory, MANIFEST)):
      raise DataError(f"data.encoder_cache={directory} exists and is not an encoder cache (no {MANIFEST}), so "
                      "writing one there would replace what it holds: choose a new or empty directory")
    self.partial = f"{self.directory}.partial-{os.getpid()}"
    shutil.rmtree(self.partial, ignore_errors=True)
    os.makedirs(self.partial)
    self.shard_size = shard_size
    self.pending: dict[str, list[np.ndarray]] = {}
    self.fields: dict[str, dict] = {}
    self.shards: list[dict] = []
    self.tables: dict[str, dict] = {}
    self.groups: dict[str, int] = {}

  def add(self, batch: dict[str, np.ndarray], *, num_samples: int) -> None:
    """batch: fields with the samples on the leading axis; a field of k rows a sample ([num_samples * k,
    ...]: perception's cameras) is stored [num_samples, k, ...] and read back as it came."""
    batch = dict(batch)
    for name, value in batch.items():
      rows = len(value)
      if rows != num_samples and rows % num_samples == 0:
        batch[name] = np.asarray(value).reshape(num_samples, rows // num_samples, *np.shape(value)[1:])
        self.groups[name] = rows // num_samples
    counts = {name: len(value) for name, value in batch.items()}
    if len(set(counts.values())) != 1:
      raise ValueError(f"error: cached fields hold different sample counts {counts}")
    for name, value in batch.items():
      value = np.asarray(value)
      spec = {"dtype": value.dtype.name, "shape": list(value.shape[1:])}
      if self.fields.setdefault(name, spec) != spec:
        raise ValueError(f"error: cached field {name} changed from {self.fields[name]} to {spec}")
      self.pending.setdefault(name, []).append(value)
    while self._pending_count() >= self.shard_size:
      self._write_shard(self.shard_size)

  def _pending_count(self) -> int:
    return sum(len(v) for v in next(iter(self.pending.values()), []))

  def _write_shard(self, count: int) -> None:
    name = f"shard_{len(self.shards):05d}"
    path = os.path.join(self.partial, name)
    os.makedirs(path)
    files = {}
    for field, parts in self.pending.items():
      joined = np.concatenate(parts)
      files[field] = _save(os.path.join(path, f"{field}.npy"), joined[:count])
      self.pending[field] = [joined[count:]] if len(joined) > count else []
    self.shards.append({"name": name, "samples": count, "files": files})

  def add_table(self, name: str, rows: list[np.ndarray], *, index_field: str, length: int) -> None:
    """A ragged table: rows [n_i, ...] stored once, a batch's rows gathered by its `index_field` and
    zero-padded to `length` (the prompts' text embeddings: umT5 writes zeros past the prompt)."""
    os.makedirs(os.path.join(self.partial, "tables"), exist_ok=True)
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    base = os.path.join(self.partial, "tables", name)
    self.tables[name] = {"index_field": index_field, "length": int(length), "rows": len(rows),
                         "dtype": rows[0].dtype.name, "files": {
                             name: _save(f"{base}.npy", np.concatenate(rows)),
                             f"{name}_offsets": _save(f"{base}_offsets.npy", offsets)}}

  def finish(self, **manifest: Any) -> dict:
    """Writes the last shard and the manifest (manifest: inputs, frozen, norm_stats, ...), then
    replaces `directory` with the complete cache. Returns the manifest."""
    if self.pending and self._pending_count():
      self._write_shard(self._pending_count())
    fields = {name: dict(spec, group=self.groups.get(name, 1)) for name, spec in self.fields.items()}
    manifest = jsonable(dict(manifest, format=FORMAT, fields=fields, tables=self.tables, shards=self.shards,
                             num_samples=sum(s["samples"] for s in self.shards), created=time.strftime(
                                 "%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    with open(os.path.join(self.partial, MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    old = f"{self.directory}.old-{os.getpid()}"
    if os.path.exists(self.directory):
      os.replace(self.directory, old)
    os.replace(self.partial, self.directory)
    shutil.rmtree(old, ignore_errors=True)
    return manifest

  def abort(self) -> None:
    shutil.rmtree(self.partial, ignore_errors=True)


# -- reading ------------------------------------------------------------------------------------------
def read_manifest(directory: str, *, rerun: str = "") -> dict:
  path = os.path.join(os.path.expanduser(directory), MANIFEST)
  if not os.path.isfile(path):
    raise StaleCache(f"data.encoder_cache={directory} holds no finished cache (no {MANIFEST}): "
                    f"write it first{rerun}")
  try:
    with open(path) as f:
      manifest = json.load(f)
  except (OSError, ValueError) as error:
    raise DataError(f"the encoder cache's manifest is unreadable ({error}): rewrite the cache{rerun}",
                    path=path) from None
  if manifest.get("format") != FORMAT:
    raise StaleCache(f"the encoder cache is format {manifest.get('format')!r}, this ejax reads {FORMAT!r}: "
                    f"rewrite it{rerun}", path=path)
  return manifest


def check_inputs(manifest: dict, config, directory: str, *, rerun: str = "") -> None:
  """One line naming the first setting the cache was written with that the run's config does not have."""
  for dotted, cached in manifest.get("inputs", {}).items():
    current = config_value(config, dotted)
    if current != cached:
      short = lambda v: (s if len(s := json.dumps(v)) <= 80 else s[:77] + "...")
      raise StaleCache(f"the encoder cache {directory} was written with {dotted}={short(cached)}, this run has "
                      f"{short(current)}: its cached outputs would be stale; rewrite it{rerun}")


def verify_files(directory: str, manifest: dict) -> None:
  """Every file's size and sha256 as the manifest records them (a truncated or altered shard: one line)."""
  listed = [(os.path.join(directory, s["name"], f"{field}.npy"), info)
            for s in manifest["shards"] for field, info in s["files"].items()]
  listed += [(os.path.join(directory, "tables", f"{name}.npy"), info)
             for table in manifest["tables"].values() for name, info in table["files"].items()]
  for path, info in listed:
    if not os.path.isfile(path) or os.path.getsize(path) != info["bytes"]:
      raise DataError(f"an encoder cache file is missing or truncated (expected {info['bytes']} bytes): rewrite "
                      "the cache", path=path)
    if _sha256(path) != info["sha256"]:
      raise DataError("an encoder cache file does not match its manifest's sha256: rewrite the cache", path=path)


def fingerprint(tree, components: Iterable[str]) -> str:
  """A sha256 over the bits of every parameter under `components` (top-level names of an nnx.State or
  dict): each array reduced on its devices to two position-weighted integer sums of its bit patterns
  (integer sums are exact in any order, so any mesh gives the same value), with its path, shape and dtype."""
  import jax
  import jax.numpy as jnp
  components = tuple(components)
  leaves = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[0] in components and hasattr(leaf, "dtype"):
      leaves.append(("/".join(names), leaf))
  if not leaves:
    raise ValueError(f"error: no parameters under {components} to fingerprint")
  leaves.sort(key=lambda item: item[0])

  def sums(x):
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)   # 8 bytes: two uint32 each
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    position = jnp.arange(bits.size, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(bits * (position * jnp.uint32(2654435761) + 1)),
                      jnp.sum((bits ^ (bits >> 7)) * (position * jnp.uint32(40503) + jnp.uint32(12345)))])

  values = np.asarray(jax.device_get(jax.jit(lambda xs: jnp.stack([sums(x) for x in xs]))([l for _, l in leaves])))
  digest = hashlib.sha256()
  for (name, leaf), pair in zip(leaves, values):
    digest.update(f"{name}:{tuple(leaf.shape)}:{leaf.dtype}:{int(pair[0])}:{int(pair[1])};".encode())
  return digest.hexdigest()


class CachedBatches:
  """Process-local batches from a cache: a fresh permutation of every sample each epoch (a function of
  seed and epoch), this process's share of each global batch, the tables gathered and padded. Exact
  get_state / set_state; `norm_stats` as the encode job's pipeline had them."""

  def __init__(self, directory: str, *, config, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, rerun: str = ""):
    self.directory, self.rerun = directory, rerun
    directory = os.path.expanduser(directory)
    started = time.perf_counter()
    self.manifest = manifest = read_manifest(directory, rerun=rerun)
    check_inputs(manifest, config, directory, rerun=rerun)
    verify_files(directory, manifest)
    self.verify_seconds = time.perf_counter() - started
    self.norm_stats = manifest.get("norm_stats") or {}
    self.batch_size, self.seed = batch_size, seed
    self.process_index, self.process_count = process_index, process_count
    num_epochs = config.data.get("num_epochs", None) if "data" in config else None
    self.num_epochs = None if num_epochs is None else int(num_epochs)
    self.num_samples = int(manifest["num_samples"])
    if self.num_samples < batch_size * process_count:
      raise DataError(f"the encoder cache {directory} holds {self.num_samples} samples, fewer than one global "
                      f"batch of {batch_size * process_count}")
    self.shards = [{field: np.load(os.path.join(directory, s["name"], f"{field}.npy"), mmap_mode="r")
                    for field in s["files"]} for s in manifest["shards"]]
    self.starts = np.cumsum([0] + [s["samples"] for s in manifest["shards"]])
    self.tables = {}
    for name, table in manifest["tables"].items():
      rows = np.load(os.path.join(directory, "tables", f"{name}.npy"))
      self.tables[name] = (rows.view(_logical_dtype(table["dtype"])),
                           np.load(os.path.join(directory, "tables", f"{name}_offsets.npy")), table)
    self.epoch, self.position = 0, 0

  # the trainer's hook: called with its frozen parameters once the state is built
  def check_frozen(self, frozen) -> None:
    want = self.manifest["frozen"]
    have = fingerprint(frozen, want["components"])
    if have != want["fingerprint"]:
      raise StaleCache(f"the encoder cache {self.directory} was encoded by other frozen weights than this run's "
                      f"{'/'.join(want['components'])} (fingerprint {want['fingerprint'][:12]} vs "
                      f"{have[:12]}: another seed or other imported weights): rewrite it{self.rerun}")

  def __iter__(self):
    return self

  def _order(self, epoch: int) -> np.ndarray:
    """The epoch's permutation, the input pipeline's (ejax/data/pipeline.py), made once an epoch."""
    if getattr(self, "_permutation", (None,))[0] != epoch:
      self._permutation = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
    return self._permutation[1]

  def __next__(self) -> dict[str, np.ndarray]:
    global_batch = self.batch_size * self.process_count
    if self.position + global_batch > self.num_samples:
      self.epoch, self.position = self.epoch + 1, 0
    if self.num_epochs is not None and self.epoch >= self.num_epochs:
      raise StopIteration
    start = self.position + self.process_index * self.batch_size
    indices = self._order(self.epoch)[start:start + self.batch_size]
    self.position += global_batch
    return self.gather(indices)

  def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The samples at `indices` (cache order) as one batch."""
    shard_of = np.searchsorted(self.starts, indices, side="right") - 1
    batch = {}
    for field, spec in self.manifest["fields"].items():
      rows = [self.shards[s][field][i - self.starts[s]] for s, i in zip(shard_of, indices)]
      value = np.stack(rows).view(_logical_dtype(spec["dtype"]))
      batch[field] = value.reshape(-1, *value.shape[2:]) if spec.get("group", 1) > 1 else value
    for name, (rows, offsets, table) in self.tables.items():
      index = batch[table["index_field"]]
      out = np.zeros((len(index), table["length"], *rows.shape[1:]), rows.dtype)
      for n, i in enumerate(index):
        part = rows[offsets[i]:offsets[i + 1]]
        out[n, :len(part)] = part
      batch[name] = out
    return batch

  def get_state(self) -> dict[str, int]:
    return {"epoch": self.epoch, "position": self.position}

  def set_state(self, state: dict) -> None:
    if not isinstance(state, dict) or set(state) != {"epoch", "position"}:
      raise DataError("the checkpoint's data position is the input pipeline's, not an encoder cache's: resume "
                      "with the data.encoder_cache setting it was trained with")
    self.epoch, self.position = int(state["epoch"]), int(state["position"])

  def close(self) -> None:
    self.shards, self.tables = [], {}
