"""Parameter values made on the host with numpy, placed straight into their shardings: no program to compile.

Compiling the random initialisation is what made start-up slow: XLA compiled one random-init
computation per parameter (219 s on an H200 for the full GR00T), and even one vmapped computation
per kind of parameter took over 200 s there. numpy draws the same distributions with no compile
at all, several leaves at once on the host's cores (it releases the GIL while it fills an array),
and `jax.make_array_from_callback` hands each device its shard (each process places its own).

`host_initializer(init)` recognises jax.nn.initializers' own functions (variance scaling with its
truncated normal / normal / uniform, normal, truncated normal, uniform, constant, zeros, ones) by
their code and captured settings and returns a numpy version of it, or None for anything else (the
caller then runs that initializer on the device). Values follow the same distributions as jax's,
from a numpy generator seeded by the parameter's own jax key: deterministic per seed, not the same
draws as jax.random.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Callable

import jax
import numpy as np

HostInit = Callable[[np.random.Generator, tuple, np.dtype], np.ndarray]
_TRUNCATED_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2] (jax's constant)


def _fans(shape, in_axis, out_axis, batch_axis) -> tuple[float, float]:
  """jax.nn.initializers' fan-in / fan-out of a weight of this shape."""
  if len(shape) <= 1:
    raise ValueError(f"variance scaling needs a weight of at least 2 dimensions, got shape {shape}")
  ndim = len(shape)
  in_axes = [a % ndim for a in ((in_axis,) if isinstance(in_axis, int) else in_axis)]
  out_axes = [a % ndim for a in ((out_axis,) if isinstance(out_axis, int) else out_axis)]
  batch_axes = [a % ndim for a in ((batch_axis,) if isinstance(batch_axis, int) else batch_axis)]
  in_size = math.prod(shape[a] for a in in_axes)
  out_size = math.prod(shape[a] for a in out_axes)
  receptive = math.prod(shape) / (in_size * out_size * math.prod(shape[a] for a in batch_axes))
  return in_size * receptive, out_size * receptive


def _truncated_normal(rng: np.random.Generator, shape, lower: float, upper: float) -> np.ndarray:
  """Unit normal truncated to [lower, upper] by redrawing what falls outside."""
  values = rng.standard_normal(shape, dtype=np.float32)
  outside = (values < lower) | (values > upper)
  while outside.any():
    values[outside] = rng.standard_normal(int(outside.sum()), dtype=np.float32)
    outside = (values < lower) | (values > upper)
  return values


def _variance_scaling(scale, mode, distribution, in_axis, out_axis, batch_axis) -> HostInit:
  def init(rng, shape, dtype):
    fan_in, fan_out = _fans(shape, in_axis, out_axis, batch_axis)
    denominator = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2,
                   "fan_geo_avg": math.sqrt(fan_in * fan_out)}[mode]
    variance = scale / denominator
    if distribution == "truncated_normal":
      return _truncated_normal(rng, shape, -2.0, 2.0) * np.float32(math.sqrt(variance) / _TRUNCATED_STD)
    if distribution == "normal":
      return rng.standard_normal(shape, dtype=np.float32) * np.float32(math.sqrt(variance))
    return rng.uniform(-1.0, 1.0, shape).astype(np.float32) * np.float32(math.sqrt(3 * variance))
  if mode not in ("fan_in", "fan_out", "fan_avg", "fan_geo_avg") or distribution not in (
      "truncated_normal", "normal", "uniform"):
    return None
  return init


def host_initializer(init) -> HostInit | None:
  """A numpy version of a jax.nn.initializers initializer, or None when `init` is not one of them."""
  code = getattr(init, "__code__", None)
  if code is None or not code.co_filename.replace(os.sep, "/").endswith("jax/_src/nn/initializers.py"):
    return None
  cells = dict(zip(code.co_freevars, (c.cell_contents for c in (init.__closure__ or ()))))
  name = code.co_qualname
  if name == "zeros":
    return lambda rng, shape, dtype: np.zeros(shape, np.float32)
  if name == "ones":
    return lambda rng, shape, dtype: np.ones(shape, np.float32)
  if name == "constant.<locals>.init" and np.ndim(cells.get("value")) == 0:
    return lambda rng, shape, dtype: np.full(shape, cells["value"], np.float32)
  if name == "normal.<locals>.init":
    return lambda rng, shape, dtype: rng.standard_normal(shape, dtype=np.float32) * np.float32(cells["stddev"])
  if name == "uniform.<locals>.init":
    return lambda rng, shape, dtype: rng.uniform(0.0, cells["scale"], shape).astype(np.float32)
  if name == "truncated_normal.<locals>.init":
    return lambda rng, shape, dtype: (_truncated_normal(rng, shape, cells["lower"], cells["upper"])
                                      * np.float32(cells["stddev"]))
  if name == "variance_scaling.<locals>.init":
    return _variance_scaling(cells["scale"], cells["mode"], cells["distribution"], cells["in_axis"],
                             cells["out_axis"], cells["batch_axis"])
  return None


def generator(key: jax.Array) -> np.random.Generator:
  """A numpy generator seeded by a jax key's bits (deterministic per parameter and seed)."""
  return np.random.default_rng([int(x) for x in np.asarray(jax.random.key_data(key)).ravel()])


def place(value: np.ndarray, sharding) -> jax.Array:
  """A host array as a global jax.Array in `sharding`; each process places its own devices' shards."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def make_all(jobs: list, workers: int | None = None) -> list[jax.Array]:
  """[(host init, jax key, shape, dtype, sharding)] -> placed arrays, drawn in parallel on the host."""
  def one(job):
    init, key, shape, dtype, sharding = job
    value = init(generator(key), tuple(shape), np.dtype(dtype))
    return place(np.asarray(value).astype(dtype, copy=False), sharding)

  workers = workers or min(16, os.cpu_count() or 1)
  if workers == 1 or len(jobs) < 2:
    return [one(job) for job in jobs]
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(one, jobs))


def place_value(value, sharding) -> jax.Array:
  """A small value made while building the model (RNG keys and counts, eagerly computed parameters)
  as a global jax.Array in `sharding`; typed PRNG keys travel as their key data."""
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(place(np.asarray(jax.random.key_data(value)), sharding),
                                    impl=jax.random.key_impl(value))
  return place(np.asarray(value), sharding)


def zeros(struct, sharding) -> jax.Array:
  """A zero array of `struct`'s shape and dtype in `sharding` (no program compiled)."""
  return place(np.zeros(struct.shape, struct.dtype), sharding)
