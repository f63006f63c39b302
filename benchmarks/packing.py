"""Packed rows with variable-length attention vs padding to fixed shapes: training samples/s.

The same samples, the same model and the same train step (forward, backward, AdamW), two layouts:
  padded: every sample laid out as openpi does: 3 camera slots of 256 tokens (empty slots masked),
          the instruction padded to 200 tokens, then the state and action tokens; dense masked
          attention, which materialises every masked score;
  packed: the real tokens of each sample packed into rows (ejax.data.packing, best fit; the row
          length, a multiple of 128 in 2048..4096, is the one that leaves the least padding) with
          segment ids and per-segment positions; the varlen op (impl "xla" on CPU, the Pallas
          kernel on GPU), which skips tiles no segment pair allows.
The padded arm's attention is `jax.nn.dot_product_attention(implementation="xla")` with the dense
mask: the fastest dense masked attention on CPU available here (ejax's reference op is ~15 % slower).
Sample lengths: 1-3 cameras (uniform) x 256 tokens, an instruction of 5-60 tokens (uniform),
1 state token and 16 action tokens (GR00T's layout), so 278..845 real tokens in 985 padded.
The mask is pi0's block-causal one: prefix bidirectional, state and actions each a new block.
Both arms are jitted and warmed up twice (a jitted step fed its own output compiles once more);
then each round trains one epoch of each arm over the same samples, their steps alternating so
that both arms see the same load on a shared machine; samples/s averages the rounds. The loss is a
per-sample mean; the script first prints the loss of the packed arm's first batch and of the same
samples padded, at the same init, to show that both arms compute the same thing.

Both arms train data-parallel, as a multi-core CPU host trains: one XLA:CPU device per core
(--xla_force_host_platform_device_count, set below before jax starts, unless the user set a count),
a 1-D mesh over them, and a step that is jax.shard_map over the batch rows: each device computes
the loss and gradients of its rows (padded: 4 of the 8 rows, packed: 1 of the 2, on 2 cores), the
loss sums, sample counts and gradients are summed over the mesh (so the loss stays the exact
per-sample mean when devices hold different numbers of samples, as packed rows do), and the
replicated AdamW update follows. Why: XLA:CPU runs a loop's iterations, and independent loops of
one program, on one thread; it threads only large single ops. Single-device, the packed arm's
attention tile loop ran on one core while XLA spread the padded arm's big dense matmuls over both
(measured per thread); with a device per core each device runs its own rows' tile loop on its own
thread, concurrently. The device count is the largest (up to the cores) that divides both
--padded_batch and --rows_per_batch; on GPU the step runs on one GPU, as before.

On CPU the packed arm's attention uses the op's CPU tiles (tiles.CPU_BLOCK_SIZES: 128x64 forward,
64x64 backward, measured fastest for these rows; 128x128 cost ~1.5x as much). The model's norms
write their input's gradient out once (ejax.models.layers.materialize_cotangent); before that, XLA
recomputed the residual gradient of every later layer inside each weight-gradient consumer, ~19 %
of a packed step. Epochs now (2026-11-21, 2 devices): packed 4.5-5.5 s and padded 13.3-18.1 s at
load 1.3-3.2; packed 3.0-3.8 s and padded 8.7-12.5 s with the machine otherwise idle. The headline
measured 3.04-3.48x over ten runs (BENCHMARKS.md).

  python benchmarks/packing.py            # headline: CPU, width 128, 3 layers, 48 samples
"""

from __future__ import annotations

import argparse
import functools
import os
import time

# One XLA:CPU device per core, set before jax creates its CPU client (the module docstring says
# why). The flag only shapes the host platform: on a GPU the benchmark still runs on one GPU.
# A device count the user set (XLA_FLAGS or JAX_NUM_CPU_DEVICES) is kept.
if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
    and "JAX_NUM_CPU_DEVICES" not in os.environ
    and os.environ.get("JAX_PLATFORMS", "cpu").lower() in ("", "cpu")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={os.cpu_count() or 1}")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ejax.data.packing import assemble_rows, pack_sequences
from ejax.kernels.attention import attention, attention_mask
from ejax.kernels.attention.tiles import (CPU_BLOCK_SIZES, GPU_BLOCK_SIZES, XLA_GPU_BLOCK_SIZES, MaskInputs,
                                          active_fraction)
from ejax.models.layers import LayerNorm, MLP, Attention as AttentionProjections, Dense
from ejax.parallel.axes import EMBED, IN_FEATURES

CAMERA_TOKENS, CAMERA_SLOTS, INSTRUCTION_PAD, STATE_TOKENS, ACTION_TOKENS = 256, 3, 200, 1, 16
PADDED_LENGTH = CAMERA_SLOTS * CAMERA_TOKENS + INSTRUCTION_PAD + STATE_TOKENS + ACTION_TOKENS
FEATURES, ACTION_DIM = 32, 8
GOAL = 2.9
DATA = "data"  # the one mesh axis: batch rows are split over it, parameters replicated


def make_samples(num_samples: int, seed: int):
  """Per sample: token features, block ids (0 prefix, 1 state, 2 actions), action mask, targets."""
  rng = np.random.default_rng(seed)
  cameras = rng.integers(1, CAMERA_SLOTS + 1, num_samples)
  instructions = rng.integers(5, 61, num_samples)
  samples = []
  for n_cam, n_text in zip(cameras, instructions):
    prefix = n_cam * CAMERA_TOKENS + n_text
    length = prefix + STATE_TOKENS + ACTION_TOKENS
    block_ids = np.zeros(length, np.int32)
    block_ids[prefix:prefix + STATE_TOKENS] = 1
    block_ids[prefix + STATE_TOKENS:] = 2
    samples.append(dict(
        features=rng.normal(size=(length, FEATURES)).astype(np.float32),
        block_ids=block_ids,
        action_mask=(block_ids == 2).astype(np.float32),
        targets=rng.normal(size=(length, ACTION_DIM)).astype(np.float32),
        n_cam=np.full(length, n_cam, np.int32), n_text=np.full(length, n_text, np.int32)))
  return samples


def padded_layout(sample) -> dict[str, np.ndarray]:
  """openpi's fixed layout: camera slots, instruction padded to 200, state, actions; 0 = padding."""
  n_cam, n_text = int(sample["n_cam"][0]), int(sample["n_text"][0])
  slots = np.zeros(PADDED_LENGTH, bool)
  slots[:n_cam * CAMERA_TOKENS] = True
  text_start = CAMERA_SLOTS * CAMERA_TOKENS
  slots[text_start:text_start + n_text] = True
  slots[text_start + INSTRUCTION_PAD:] = True
  out = {}
  for key in ("features", "block_ids", "action_mask", "targets"):
    value = sample[key]
    full = np.zeros((PADDED_LENGTH,) + value.shape[1:], value.dtype)
    full[slots] = value
    out[key] = full
  out["segment_ids"] = slots.astype(np.int32)
  out["positions"] = np.where(slots, np.cumsum(slots) - 1, 0).astype(np.int32)
  return out


class Block(nnx.Module):
  def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
    self.norm1 = LayerNorm(width, rngs=rngs)
    self.attn = AttentionProjections(width, num_heads=heads, rngs=rngs)
    self.norm2 = LayerNorm(width, rngs=rngs)
    self.mlp = MLP(width, 4 * width, rngs=rngs)

  def __call__(self, x, batch, impl: str):
    normed = self.norm1(x)
    q, k, v = self.attn.project_qkv(normed, normed)
    mask = dict(mask_kind="block_causal", q_segment_ids=batch["segment_ids"],
                kv_segment_ids=batch["segment_ids"], q_block_ids=batch["block_ids"],
                kv_block_ids=batch["block_ids"])
    if impl == "dense":
      # The padded baseline: XLA's dense masked attention (faster on CPU than ejax's reference
      # op, which is the same algorithm written for clarity). Padding queries get an average
      # instead of zeros; no key sees them and they carry no loss, so the loss is unchanged.
      dense_mask = attention_mask(x.shape[1], x.shape[1], batch=x.shape[0], **mask)
      attended = jax.nn.dot_product_attention(q, k, v, mask=dense_mask[:, None], implementation="xla")
    else:
      attended = attention(q, k, v, impl=impl, **mask)
    x = x + self.attn.o_proj(attended)
    return x + self.mlp(self.norm2(x))


class PolicyTransformer(nnx.Module):
  """A small action-head-like transformer: token features -> blocks -> per-token action."""

  def __init__(self, width: int, depth: int, heads: int, rngs: nnx.Rngs):
    self.embed = Dense(FEATURES, width, axes=(IN_FEATURES, EMBED), rngs=rngs)
    self.position = nnx.Embed(1024, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(depth)])
    self.norm = LayerNorm(width, rngs=rngs)
    self.head = Dense(width, ACTION_DIM, axes=(EMBED, IN_FEATURES), rngs=rngs)

  def __call__(self, batch, impl: str):
    x = self.embed(batch["features"]) + self.position(batch["positions"])
    for block in self.blocks:
      x = block(x, batch, impl)
    return self.head(self.norm(x))


def sample_count(batch) -> jax.Array:
  """Samples in a batch (padded or packed): each has ACTION_TOKENS action tokens."""
  return jnp.sum(batch["action_mask"]) / ACTION_TOKENS


def sample_loss_sum(model, batch, impl: str) -> jax.Array:
  """Sum over samples of each sample's mean squared error on its action tokens."""
  errors = jnp.sum((model(batch, impl) - batch["targets"]) ** 2, axis=-1) / ACTION_DIM
  return jnp.sum(errors * batch["action_mask"]) / ACTION_TOKENS


def per_sample_mean_loss(model, batch, impl: str) -> jax.Array:
  return sample_loss_sum(model, batch, impl) / jnp.maximum(sample_count(batch), 1.0)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, impl: str,
                    mesh: jax.sharding.Mesh):
  """A data-parallel step: each device's rows give loss and gradients, summed over the mesh."""

  def device_loss_and_grads(params: nnx.State, batch):
    # Each device divides its loss sum by the sample count of the whole batch, so the sums over
    # the mesh give the exact per-sample mean even when devices hold different numbers of samples
    # (packed rows do); with equal counts this is the mean of per-device means.
    total_samples = jnp.maximum(jax.lax.psum(sample_count(batch), DATA), 1.0)
    loss_fn = lambda p: sample_loss_sum(nnx.merge(graphdef, p), batch, impl) / total_samples
    # The parameters enter replicated (unvarying over DATA) and meet each device's rows: under
    # shard_map's varying-axes check the gradient of such an input comes back already summed over
    # the mesh (the transpose of its implicit broadcast), so only the loss needs a psum here.
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.lax.psum(loss, DATA), grads

  loss_and_grads = jax.shard_map(device_loss_and_grads, mesh=mesh, in_specs=(P(), P(DATA)),
                                 out_specs=(P(), P()))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))

  # Parameters and optimizer state are replaced every step: donated, they are updated in place.
  @functools.partial(jax.jit, donate_argnums=(0, 1), in_shardings=(replicated, replicated, rows),
                     out_shardings=(replicated, replicated, replicated))
  def train_step(params: nnx.State, opt_state, batch):
    loss, grads = loss_and_grads(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return train_step


def step_flops(tokens: float, attended_pairs: float, args) -> float:
  """Matmul FLOPs of a forward+backward pass (3x forward) over `tokens` tokens whose attention computes
  `attended_pairs` (query, key) pairs per layer: the work an arm's steps do."""
  width = args.width
  per_token = 2 * (FEATURES * width + args.depth * 12 * width * width + width * ACTION_DIM)
  return 3 * (tokens * per_token + 4 * attended_pairs * width * args.depth)


def flop_ratio(padded, packed, args) -> float:
  """FLOPs of the padded batches over the packed ones: every padded token and (masked) score pair
  computed, against the packed rows' tokens and the attention tiles the varlen op runs."""
  padded_rows = sum(batch["segment_ids"].shape[0] for batch in padded)
  padded_flops = step_flops(padded_rows * PADDED_LENGTH, padded_rows * PADDED_LENGTH**2, args)
  segments = np.concatenate([np.asarray(batch["segment_ids"]) for batch in packed])
  block_ids = np.concatenate([np.asarray(batch["block_ids"]) for batch in packed])
  blocks = GPU_BLOCK_SIZES if args.packed_impl in ("auto", "pallas") and jax.default_backend() == "gpu" else (
      XLA_GPU_BLOCK_SIZES if jax.default_backend() == "gpu" else CPU_BLOCK_SIZES)
  fraction = float(active_fraction(MaskInputs(segments, segments, block_ids, block_ids), blocks, ordered=True))
  packed_flops = step_flops(segments.size, fraction * segments.shape[0] * segments.shape[1]**2, args)
  return padded_flops / packed_flops


def padded_batches(samples, batch_size: int):
  layouts = [padded_layout(s) for s in samples]
  for start in range(0, len(layouts), batch_size):
    chunk = layouts[start:start + batch_size]
    yield {key: jnp.asarray(np.stack([c[key] for c in chunk])) for key in chunk[0]}


def choose_row_length(lengths, rows_per_batch: int, seed: int, shortest: int = 2048,
                      longest: int = 4096, step: int = 128) -> int:
  """The row length (a multiple of the CPU tile, 128) that packs these samples into the fewest tokens.

  A data pipeline picks its row length once per dataset; the best-fit packer leaves a different
  tail of padding at each length (8.9 % at 2048 for the headline samples, 1.9 % at 3328), and every
  padding token costs the packed arm a full MLP pass. Rows are counted after topping up the last
  batch, as packed_batches does. Ties go to the shorter row.
  """
  def tokens(row_length: int) -> int:
    rows = len(pack_sequences(lengths, row_length, seed=seed))
    return (rows + -rows % rows_per_batch) * row_length
  return min(range(shortest, longest + 1, step), key=lambda n: (tokens(n), n))


def packed_batches(samples, row_length: int, rows_per_batch: int, seed: int):
  keys = ("features", "block_ids", "action_mask", "targets")
  trimmed = [{key: s[key] for key in keys} for s in samples]
  rows = pack_sequences([len(s["block_ids"]) for s in trimmed], row_length, seed=seed)
  # Fixed shapes: the last batch is topped up with empty rows, whose cost the packed arm pays.
  rows += [[] for _ in range(-len(rows) % rows_per_batch)]
  packed = assemble_rows(trimmed, rows, row_length)
  arrays = dict(packed.arrays, segment_ids=packed.segment_ids, positions=packed.positions)
  batches = [{key: jnp.asarray(value[start:start + rows_per_batch]) for key, value in arrays.items()}
             for start in range(0, len(rows), rows_per_batch)]
  first_batch_samples = [i for row in rows[:rows_per_batch] for i in row]
  return batches, packed.padding_fraction, len(rows), first_batch_samples


class Arm:
  """One layout's parameters, optimizer state and data-parallel step; `timed_step` times a step."""

  def __init__(self, batches, impl: str, mesh: jax.sharding.Mesh, args):
    # Batch rows live split over the mesh before the step, as a data loader would put them.
    self.batches = [jax.device_put(batch, NamedSharding(mesh, P(DATA))) for batch in batches]
    graphdef, params = nnx.split(PolicyTransformer(args.width, args.depth, args.heads, nnx.Rngs(0)),
                                 nnx.Param)
    optimizer = optax.adamw(1e-4)
    replicated = NamedSharding(mesh, P())
    self.params = jax.device_put(params, replicated)
    self.opt_state = jax.device_put(optimizer.init(params), replicated)
    self.step = make_train_step(graphdef, optimizer, impl, mesh)
    for _ in range(2):
      self._run(0).block_until_ready()

  def _run(self, index: int) -> jax.Array:
    self.params, self.opt_state, loss = self.step(self.params, self.opt_state, self.batches[index])
    return loss

  def timed_step(self, index: int) -> float:
    start = time.perf_counter()
    self._run(index).block_until_ready()
    return time.perf_counter() - start


def data_mesh(args) -> jax.sharding.Mesh:
  """A 1-D mesh over CPU devices (the most that split both arms' batches evenly); one GPU on GPU."""
  devices = jax.devices()
  count = 1
  if jax.default_backend() == "cpu":
    count = max(n for n in range(1, len(devices) + 1)
                if args.padded_batch % n == 0 and args.rows_per_batch % n == 0)
    if count < len(devices):
      print(f"using {count} of {len(devices)} CPU devices: the largest count that divides both "
            f"--padded_batch {args.padded_batch} and --rows_per_batch {args.rows_per_batch}")
  return jax.make_mesh((count,), (DATA,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices[:count])


def check_same_losses(samples, packed_batch, sample_indices, packed_impl: str, args):
  """Loss of the packed arm's first batch and of the same samples padded, at the same init."""
  model = PolicyTransformer(args.width, args.depth, args.heads, nnx.Rngs(0))
  loss = nnx.jit(per_sample_mean_loss, static_argnums=2)
  same_padded = next(padded_batches([samples[i] for i in sample_indices], len(sample_indices)))
  return float(loss(model, same_padded, "dense")), float(loss(model, packed_batch, packed_impl))


def main():
  # Parameters carry logical names, but here they are all replicated over the data mesh.
  nnx.use_eager_sharding(False)
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--samples", type=int, default=48)
  parser.add_argument("--padded_batch", type=int, default=8)
  parser.add_argument("--row_length", type=int, default=0,
                      help="tokens per packed row; 0 picks the one with the least padding")
  parser.add_argument("--rows_per_batch", type=int, default=2)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--depth", type=int, default=3)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--packed_impl", default="auto" if jax.default_backend() == "gpu" else "xla")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  samples = make_samples(args.samples, args.seed)
  lengths = np.array([len(s["block_ids"]) for s in samples])
  padded = list(padded_batches(samples, args.padded_batch))
  if args.row_length == 0:
    args.row_length = choose_row_length([int(n) for n in lengths], args.rows_per_batch, args.seed)
  packed, packed_padding, num_rows, first_samples = packed_batches(samples, args.row_length, args.rows_per_batch,
                                                    args.seed)
  padded_padding = 1.0 - lengths.sum() / (len(samples) * PADDED_LENGTH)
  mesh = data_mesh(args)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}) x {mesh.size} "
        f"data-parallel, jax {jax.__version__}")
  print(f"{len(samples)} samples, lengths {lengths.min()}..{lengths.max()} (mean {lengths.mean():.0f}); "
        f"model width {args.width}, depth {args.depth}, {args.heads} heads")
  print(f"padded: {len(padded)} batches of {args.padded_batch} x {PADDED_LENGTH} tokens, "
        f"padding {padded_padding:.1%}, dense masked attention (jax.nn, xla)")
  print(f"packed: {len(packed)} batches of {args.rows_per_batch} x {args.row_length} tokens "
        f"({num_rows} rows), padding {packed_padding:.1%}, varlen attention (impl {args.packed_impl})")
  bound = flop_ratio(padded, packed, args)
  print(f"FLOP ratio of the padded and packed batches (tokens' matmuls + attention tiles run): {bound:.2f}x")
  print(f"ideal attention FLOP ratio (padded length^2 / sum len^2 per sample): "
        f"{PADDED_LENGTH**2 / np.mean(lengths.astype(float)**2):.2f}x; token ratio "
        f"{PADDED_LENGTH / lengths.mean():.2f}x")

  padded_loss, packed_loss = check_same_losses(samples, packed[0], first_samples, args.packed_impl, args)
  print(f"loss of the packed arm's first {len(first_samples)} samples at init: padded {padded_loss:.5f}, "
        f"packed {packed_loss:.5f}")
  arms = {"padded": Arm(padded, "dense", mesh, args),
          "packed": Arm(packed, args.packed_impl, mesh, args)}
  # Steps of the two arms alternate, so both see the same (shared, fluctuating) machine.
  seconds = {name: [0.0] * args.rounds for name in arms}
  for round_index in range(args.rounds):
    for step_index in range(max(len(arm.batches) for arm in arms.values())):
      for name, arm in arms.items():
        if step_index < len(arm.batches):
          seconds[name][round_index] += arm.timed_step(step_index)
  print("epoch seconds per round: " + ", ".join(
      f"{name} {' '.join(f'{s:.1f}' for s in values)}" for name, values in seconds.items()))
  padded_seconds, packed_seconds = (sum(seconds[name]) / args.rounds for name in ("padded", "packed"))
  padded_rate, packed_rate = len(samples) / padded_seconds, len(samples) / packed_seconds
  print(f"padded: {padded_rate:.2f} samples/s ({padded_seconds:.2f} s)")
  print(f"packed: {packed_rate:.2f} samples/s ({packed_seconds:.2f} s)")
  # The FLOP ratio bounds the speedup when both arms run at the same FLOP rate; on CPU the dense arm's
  # masked scores run slower per FLOP than the packed arm's tiles, so the measured ratio can exceed it.
  print(f"packed/padded samples per second: {packed_rate / padded_rate:.2f}x; FLOP ratio of the padded and packed "
        f"batches {bound:.2f}x (the bound at equal FLOP rates) (goal {GOAL}x)")


if __name__ == "__main__":
  main()
