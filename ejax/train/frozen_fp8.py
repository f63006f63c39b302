"""train.frozen_fp8: the frozen projections' kernels kept in FP8 too, made once with the state.

The frozen towers' GEMMs are the largest of GR00T's step (SigLIP's and the LLM's, over every image
patch and prompt token, forward only). Quantising their weights on the fly cost what FP8 saved (a
pass over 1.2B weights every step, BENCHMARKS.md), so here each frozen kernel of a layer that takes
one (a module class with `FP8_CONTRACTED`: ejax.models.layers' Dense, HeadProjection,
OutputProjection) is quantised once, when the state is made, into the state's `frozen_fp8`: an
nnx.State of `Fp8Copy` variables, `values` (e4m3, [out, in]) and `scale` per kernel, sharded as the
kernel is, and the scale of a layer's input where a bound on it holds for any input (one per norm
for the projections reading it, one per attention for its o_proj: `_input_sources`, `input_bound`).
The train step puts each copy in its kernel's place (`substitute`) and the layer runs one FP8 GEMM
(ejax.kernels.fp8.frozen). The frozen weights themselves stay as they are: imports,
exports, evaluation and serving read them, and a checkpoint holds both (the copy is 1 byte a weight).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ejax.kernels.fp8.frozen import FrozenKernel, quantize_kernel
from ejax.kernels.fp8.quantize import E4M3
from ejax.kernels.fp8.xla import power_of_two_scale
from ejax.parallel.params import variable_axis_names

# Kernels narrower than this on either side stay in bf16: one partial tile of an FP8 GEMM gains no
# speed and loses precision (the same rule as kernels.fp8.quantize_params' min_features).
MIN_FEATURES = 128


class Fp8Copy(nnx.Variable):
  """A frozen kernel's FP8 copy: its e4m3 values or its scale. Not a Param: nothing trains it."""


def _child(module, dotted: str):
  for name in dotted.split("."):
    module = getattr(module, name, None)
  return module


def _input_sources(model: nnx.Module) -> dict:
  """kernel path -> how its input is bounded, for the projections whose input a norm makes (a
  module's FP8_INPUT_NORMS: norm -> the module reading it): ("norm", norm path, zero-centred) for a
  projection reading the norm's output, ("values", norm path, zero-centred, v_proj path) for an
  attention's o_proj, whose input is a convex combination of its v_proj's outputs."""
  sources = {}
  for path, node in nnx.iter_graph(model):
    for norm_name, reader_name in (getattr(type(node), "FP8_INPUT_NORMS", None) or {}).items():
      norm, reader = getattr(node, norm_name, None), _child(node, reader_name)
      if norm is None or reader is None:
        continue
      norm_source = (tuple(path) + (norm_name,), bool(getattr(norm, "zero_centered", False)))
      reader_path = tuple(path) + tuple(reader_name.split("."))
      direct = (("",) if hasattr(type(reader), "FP8_CONTRACTED") else
                getattr(type(reader), "FP8_INPUT_PROJECTIONS", ()))
      for projection in direct:
        sources[reader_path + ((projection,) if projection else ()) + ("kernel",)] = ("norm",) + norm_source
      values = getattr(type(reader), "FP8_VALUE_PROJECTIONS", None)
      if values:
        sources[reader_path + (values[1], "kernel")] = ("values",) + norm_source + (reader_path + (values[0],),)
  return sources


def plan(model: nnx.Module, frozen: nnx.State) -> nnx.State | None:
  """The abstract copies (ShapeDtypeStructs in Fp8Copy variables) for every frozen kernel of `model`
  a layer can run in FP8; None when there is none. Per kernel: `values` and `scale` (carrying their
  sharding names and how many kernel dimensions are contracted), and `input_scale` where a bound on
  the layer's input is known (_input_sources; the bound's recipe in its metadata)."""
  frozen_paths = {tuple(path) for path, _ in nnx.to_flat_state(frozen)}
  sources = _input_sources(model)
  flat = {}
  for path, node in nnx.iter_graph(model):
    contracted = getattr(type(node), "FP8_CONTRACTED", None)
    kernel_path = tuple(path) + ("kernel",)
    if not contracted or kernel_path not in frozen_paths:
      continue
    kernel = node.kernel
    shape = kernel.get_value().shape
    inner, outer = math.prod(shape[:contracted]), math.prod(shape[contracted:])
    if min(inner, outer) < MIN_FEATURES:
      continue
    names = variable_axis_names(kernel) or (None,) * len(shape)
    source = sources.get(kernel_path)
    scale_path = None
    if (source is not None and source[1] + ("scale",) in frozen_paths
        and all(p + ("kernel",) in frozen_paths for p in source[3:])):
      # One scale per norm for the projections reading it (q, k and v share one conversion), its
      # own for an o_proj.
      scale_path = source[1] + ("output_scale",) if source[0] == "norm" else kernel_path + ("input_scale",)
      flat[scale_path] = Fp8Copy(jax.ShapeDtypeStruct((), jnp.float32), out_sharding=(), source=source)
    # [out, in]: each flattened side sharded as its leading dimension was.
    flat[kernel_path + ("values",)] = Fp8Copy(jax.ShapeDtypeStruct((outer, inner), E4M3),
                                              out_sharding=(names[contracted], names[0]), contracted=contracted,
                                              input_from=scale_path)
    flat[kernel_path + ("scale",)] = Fp8Copy(jax.ShapeDtypeStruct((), jnp.float32), out_sharding=())
  return nnx.from_flat_state(flat) if flat else None


def _norm_bounds(gain: jax.Array, bias: jax.Array | None, zero_centered: bool) -> tuple[jax.Array, jax.Array]:
  """(largest |element|, largest row L2 norm) a LayerNorm or RMSNorm with this gain and bias can output:
  its normalised row has an L2 norm of at most sqrt(dim), so each element is at most sqrt(dim) times
  the largest |gain|, plus the largest |bias| (the row: plus the bias's L2 norm)."""
  root = math.sqrt(gain.shape[0])
  gain = gain.astype(jnp.float32)
  largest = jnp.max(jnp.abs(gain + 1.0 if zero_centered else gain))
  bias = jnp.zeros((1,)) if bias is None else bias.astype(jnp.float32)
  return root * largest + jnp.max(jnp.abs(bias)), root * largest + jnp.linalg.norm(bias)


def input_bound(kind: str, zero_centered: bool, arrays: dict) -> jax.Array:
  """The bound on a projection's input that a source of `kind` (_input_sources) describes, from its
  norm's `gain` and `bias` (and for "values" the value projection's `v_kernel` and `v_bias`). A value
  projection's output j is at most the input row's L2 norm times column j's L2 norm, plus |bias j|;
  attention averages such outputs."""
  element, row = _norm_bounds(arrays["gain"], arrays.get("bias"), zero_centered)
  if kind == "norm":
    return element
  kernel = arrays["v_kernel"].astype(jnp.float32)
  columns = jnp.linalg.norm(kernel.reshape(kernel.shape[0], -1), axis=0)
  v_bias = arrays.get("v_bias")
  return row * jnp.max(columns) + (0.0 if v_bias is None else jnp.max(jnp.abs(v_bias.astype(jnp.float32))))


# The bounds hold in exact arithmetic; the norm's output is rounded to the compute dtype (bf16: up
# to 2^-9 relative) before it is quantised, which this margin covers.
BOUND_MARGIN = 1.0 + 2.0 ** -7


@functools.lru_cache(maxsize=None)
def _quantize_program(contracted: int, shardings):
  return jax.jit(lambda kernel: tuple(quantize_kernel(kernel, contracted)[:2]), out_shardings=shardings)


@functools.lru_cache(maxsize=None)
def _scale_program(kind: str, zero_centered: bool, sharding):
  return jax.jit(lambda arrays: power_of_two_scale(input_bound(kind, zero_centered, arrays) * BOUND_MARGIN),
                 out_shardings=sharding)


def _jobs(abstract: nnx.State, shardings: nnx.State) -> list[tuple]:
  """(output paths, jitted program, its inputs: a flat frozen path or a dict of them) per copy. One
  small program per kind of kernel (shape, contraction, sharding), reused for every kernel of that
  kind: 248 kernels of GR00T, ~10 programs, where one program of all of them took seconds to compile."""
  placed = {path: variable.get_value() for path, variable in nnx.to_flat_state(shardings)}
  jobs = []
  for path, variable in nnx.to_flat_state(abstract):
    metadata = variable.get_metadata()
    if path[-1] == "values":
      scale_path = path[:-1] + ("scale",)
      program = _quantize_program(metadata["contracted"], (placed[path], placed[scale_path]))
      jobs.append(((path, scale_path), program, path[:-1]))
    elif path[-1] in ("input_scale", "output_scale"):
      kind, norm_path, zero_centered, *v_path = metadata["source"]
      inputs = {"gain": norm_path + ("scale",), "bias": norm_path + ("bias",)}
      if v_path:
        inputs.update(v_kernel=v_path[0] + ("kernel",), v_bias=v_path[0] + ("bias",))
      jobs.append(((path,), _scale_program(kind, zero_centered, placed[path]), inputs))
  return jobs


def make(abstract: nnx.State, frozen: nnx.State, shardings: nnx.State) -> nnx.State:
  """The copies of `abstract` (plan's) made from the frozen weights, in `shardings`."""
  values = {path: variable.get_value() for path, variable in nnx.to_flat_state(frozen)}
  out = {}
  for outputs, program, inputs in _jobs(abstract, shardings):
    if isinstance(inputs, dict):
      made = (program({name: values[p] for name, p in inputs.items() if p in values}),)
    else:
      made = program(values[inputs])
    out.update(zip(outputs, made))
  return nnx.map_state(lambda path, variable: variable.replace(out[path]), abstract)


def compile_programs(abstract: nnx.State, frozen: nnx.State, frozen_shardings: nnx.State,
                     shardings: nnx.State) -> int:
  """Compiles, from shapes, each distinct program `make` runs (frozen: the abstract frozen weights);
  returns how many."""
  flat = {path: variable.get_value() for path, variable in nnx.to_flat_state(frozen)}
  placed = {path: variable.get_value() for path, variable in nnx.to_flat_state(frozen_shardings)}
  struct = lambda p: jax.ShapeDtypeStruct(flat[p].shape, flat[p].dtype, sharding=placed[p])
  seen = set()
  for _, program, inputs in _jobs(abstract, shardings):
    args = ({name: struct(p) for name, p in inputs.items() if p in flat},) if isinstance(inputs, dict) else \
        (struct(inputs),)
    key = (id(program), str(jax.tree.structure(args)),
           tuple((a.shape, str(a.dtype), a.sharding) for a in jax.tree.leaves(args)))
    if key not in seen:
      seen.add(key)
      program.lower(*args).compile()
  return len(seen)


def substitute(frozen: nnx.State, copies: nnx.State | None) -> nnx.State:
  """`frozen` with each copied kernel's value replaced by its FrozenKernel (what the layers run)."""
  if copies is None:
    return frozen
  flat = {path: variable for path, variable in nnx.to_flat_state(copies)}

  def put(path, variable):
    copy = flat.get(path + ("values",))
    if copy is None:
      return variable
    input_from = copy.get_metadata().get("input_from")
    return variable.replace(FrozenKernel(copy.get_value(), flat[path + ("scale",)].get_value(),
                                         None if input_from is None else flat[input_from].get_value()))

  return nnx.map_state(put, frozen)


def count(copies: nnx.State | None) -> int:
  """How many kernels have an FP8 copy."""
  return 0 if copies is None else sum(path[-1] == "values" for path, _ in nnx.to_flat_state(copies))
