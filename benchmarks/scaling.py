"""Scaling model: GR00T-N1.5 and pi0.5 training on N H100s, from train steps compiled on a CPU.

Measured (CPU only, nothing of model size allocated): each model's full-size train step, the
trainer's own, compiled by XLA for 1,024 fake CPU devices in the layout a 128-node x 8-GPU cluster
uses, data=128 x fsdp=8, 32 samples a device (the configs' 256 per 8-GPU node), by
`python -m ejax.train.compile_report` (~1.5 min a model; the result is cached under
~/.cache/ejax/scaling, keyed by the source it compiled). From its per-device program come:
  - FLOPs per sample: the matmuls of the compiled HLO with every loop counted as often as it runs
    (ejax.parallel.hlo; XLA's cost_analysis counts a scan body once), checked against the analytic
    count (ejax.train.flops: weights x the tokens they see + attention over the pairs the mask allows)
    at the compiled batch's layout: they must agree within 10 %;
  - bytes of parameters, gradients and optimizer state per device (the state's shardings);
  - every collective with its group, buffer and count per step.
Predicted for N GPUs (N/8 nodes, mesh data=N/8 x fsdp=8, 32 samples a GPU; exact for this layout:
per-GPU compute and the collectives inside a node do not change with N, and a collective across
nodes keeps its buffer while its group grows from 128 (or 1,024) to N/8 (or N)):
  compute     = analytic hardware FLOPs (rematerialised forwards included) / 798 TFLOP/s, the
                8192^3 bf16 matmul rate measured on an H100 (REFERENCE.md; 989 peak): every FLOP at
                the large-matmul rate, so this is a lower bound on compute time;
  NVLink      = bytes each GPU sends inside its node / 450 GB/s (NVLink 4: 900 GB/s bidirectional);
  InfiniBand  = bytes each GPU sends to other nodes / 50 GB/s (one 400 Gb/s NIC per GPU);
  ring algorithms: a GPU sends (n-1)/n of an all-gather's or reduce-scatter's buffer and twice that
  of an all-reduce. Two corrections from XLA:CPU to a GPU, both stated in the output: XLA:CPU runs
  every bf16 matmul in f32, so it gathers weights in f32 where a GPU gathers bf16 (halved here), and
  it writes FSDP gradient reductions inside a node as all-reduce + slice, which XLA:GPU turns into a
  reduce-scatter (half the bytes).
  step        = max(compute, NVLink, InfiniBand): XLA's latency-hiding scheduler overlaps FSDP
                collectives with compute; the serial sum is printed as the no-overlap bound.
  MFU         = analytic model FLOPs (no recomputation) x samples/s / (N x 989 TFLOP/s).
Not modelled: input loading and decoding, stragglers, the optimizer's memory-bound update, kernel
efficiency below the matmul rate (attention, elementwise work).

Token counts come from the length mix of benchmarks/packing.py (1-3 cameras x 256 tokens, a 5-60
token instruction): padded as the seed lays samples out (camera slots x 256 + instruction padded to
200), packed at the config's fixed samples per row, and packed best-fit (a variable number a row).

  python benchmarks/scaling.py           # < 5 min on CPU; instant when cached
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {"GR00T-N1.5": "configs/groot.py", "pi0.5": "configs/pi05.py"}
COMPILED_MESH = dict(data=128, fsdp=8)
NODE = 8
GPUS = (8, 64, 256, 1024)
PEAK = 989e12          # H100 SXM dense bf16 (REFERENCE.md)
MATMUL_RATE = 798e12   # 8192^3 bf16 matmul measured on the lent H100 (REFERENCE.md)
NVLINK = 450e9         # bytes/s a GPU sends inside its node
INFINIBAND = 50e9      # bytes/s a GPU sends to other nodes
SEED_MINUTES = 22.0    # the seed's GR00T-N1.5 round on ~1,000 GPUs (REFERENCE.md)
# What the compiled program and its reading depend on (the cache key).
_SOURCES = ("ejax/models", "ejax/train/step.py", "ejax/train/state.py", "ejax/train/optim.py", "ejax/parallel",
            "ejax/kernels", "ejax/data/packing.py", "ejax/data/row_plan.py", "configs")


def _cache_key(config_path: str) -> str:
  """A hash of what the compile depends on: ejax's model, train and parallel code, the configs, jax."""
  import jax
  digest = hashlib.sha256(f"{config_path} {COMPILED_MESH} {jax.__version__}".encode())
  for root in _SOURCES:
    path = os.path.join(REPO, root)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".py"))
    for name in files:
      with open(name, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()[:16]


def compiled(config_path: str, recompile: bool) -> dict:
  """compile_report's result for config_path at COMPILED_MESH (cached; a fresh process per compile)."""
  cache = os.path.join(os.environ.get("EJAX_CACHE_DIR", os.path.expanduser("~/.cache/ejax")), "scaling")
  os.makedirs(cache, exist_ok=True)
  path = os.path.join(cache, f"{os.path.basename(config_path)[:-3]}-{_cache_key(config_path)}.json")
  if recompile or not os.path.exists(path):
    mesh = ",".join(f"{k}={v}" for k, v in COMPILED_MESH.items())
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "ejax.train.compile_report", f"--config={config_path}",
                           f"--mesh={mesh}", f"--json={path}"], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
      raise SystemExit(f"compiling {config_path} failed:\n{done.stderr[-3000:]}")
    print(f"  compiled {config_path} for {mesh} in {time.time() - start:.0f} s (cached in {path})")
  with open(path) as f:
    return json.load(f)


def length_mix(model_config, count: int = 4096, seed: int = 0):
  """Real VL / prefix tokens of each sample of the mix, and the seed's padded length."""
  rng = np.random.default_rng(seed)
  per_image = (model_config.vision.image_size // model_config.vision.patch_size) ** 2
  instruction = rng.integers(5, 61, count)
  if model_config.name == "groot":
    cameras = np.full(count, model_config.num_cameras)
    lengths = 2 + cameras * per_image + instruction            # Eagle's prompt: template, images, text
    padded = model_config.num_cameras * per_image + 200
  else:
    cameras = rng.integers(1, model_config.num_cameras + 1, count)
    prompt = np.minimum(instruction + model_config.max_state_dim + 8, model_config.max_token_len)  # + state bins
    lengths = cameras * per_image + prompt
    padded = model_config.num_cameras * per_image + model_config.max_token_len
  return lengths, padded


def layouts(model_config) -> dict:
  """name -> (Layout, tokens per sample) for the padded, config-packed and best-fit packings."""
  from ejax.data import row_plan
  from ejax.data.packing import pack_sequences
  from ejax.train.flops import Layout
  lengths, padded = length_mix(model_config)
  images = model_config.num_cameras  # every camera slot is encoded (pi0.5: absent ones as blank images)
  # An auto row (model.packing.row_length = 0) is what a run on this mix would choose (ejax/data/row_plan.py).
  packing = row_plan.resolve(model_config, lengths)[0].packing
  row = packing.row_length
  real = dict(segment_length=float(lengths.mean()), segment_pairs=float(np.mean(lengths.astype(float) ** 2)),
              images=images)
  rows = len(pack_sequences([int(n) for n in lengths], row, seed=0))
  fixed = row / packing.samples_per_row
  return {
      "padded": Layout(row_tokens=padded, segment_length=padded, segment_pairs=padded**2, images=images),
      "packed": Layout(row_tokens=fixed, **real),
      "best-fit": Layout(row_tokens=rows * row / len(lengths), **real),
  }, float(lengths.mean())


def collective_seconds(ops: list[dict], gpus: int) -> tuple[float, float, dict]:
  """(NVLink s, InfiniBand s, bytes) of one step's collectives on `gpus` GPUs, from the compiled
  data=128 x fsdp=8 program (module docstring: groups across nodes rescaled to N)."""
  compiled_devices = COMPILED_MESH["data"] * COMPILED_MESH["fsdp"]
  nvlink = infiniband = 0.0
  for op in ops:
    group, buffer, kind = op["group_size"], float(op["buffer_bytes"]), op["kind"]
    if not op["crosses_nodes"]:
      if kind == "all-gather":
        buffer /= 2  # weights in bf16 on a GPU (XLA:CPU gathers its f32 upcasts)
      share = (group - 1) / group * buffer if group > 1 else 0.0
      # Inside a node, XLA:GPU writes FSDP's all-reduce + slice as a reduce-scatter: one share.
      nvlink += op["count"] * share
      continue
    new_group = gpus // NODE if group == COMPILED_MESH["data"] else gpus if group == compiled_devices else group
    if kind == "all-gather":
      buffer = buffer / group * new_group / 2  # each GPU's piece stays; bf16 on a GPU
    share = (new_group - 1) / new_group * buffer if new_group > 1 else 0.0
    sent = op["count"] * (2 * share if kind == "all-reduce" else share)
    if new_group <= NODE:
      nvlink += sent
    else:
      infiniband += sent
  return nvlink / NVLINK, infiniband / INFINIBAND, dict(nvlink=nvlink, infiniband=infiniband)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recompile", action="store_true", help="ignore the cached compile results")
  args = parser.parse_args()

  from ejax.models.registry import example_config, get_model_spec
  from ejax.train.compile_report import load_config_file
  from ejax.train.flops import layout_of_batch, train_flops_per_sample

  print(f"assumed: H100 {PEAK / 1e12:.0f} TFLOP/s peak, every FLOP at {MATMUL_RATE / 1e12:.0f} TFLOP/s; NVLink "
        f"{NVLINK / 1e9:.0f} GB/s and InfiniBand {INFINIBAND / 1e9:.0f} GB/s sent per GPU; collectives overlap "
        "compute (step = max), serial sum as the bound; input loading not modelled")
  gib = 2**30
  groot_round = None
  for name, config_path in MODELS.items():
    config = load_config_file(os.path.join(REPO, config_path))
    model = config.model
    result = compiled(config_path, args.recompile)
    per_device = result["per_device_batch"]
    print(f"\n== {name} ({config_path}): compiled for {result['devices']} devices "
          f"({' x '.join(f'{k}={v}' for k, v in result['mesh'].items() if v > 1)}), {per_device} samples a "
          f"device, lower {result['lower_seconds']:.0f} s + compile {result['compile_seconds']:.0f} s")

    # FLOPs: compiled vs analytic at the compiled batch's layout (the example batch, scaled).
    example_model = example_config(model)  # an auto row: the example batch's, as the compile laid it out
    example = get_model_spec(model.name).example_batch(example_model, 8 * int(example_model.packing.samples_per_row), 0)
    at_compiled = train_flops_per_sample(model, layout_of_batch(model, example))
    compiled_flops = result["matmul_flops_per_device"] / per_device
    xla_flops = result["xla_cost_analysis_flops_per_device"] / per_device
    ratio = compiled_flops / at_compiled.hardware
    print(f"FLOPs per sample (hardware, remat included): compiled HLO {compiled_flops / 1e12:.2f} T, analytic "
          f"{at_compiled.hardware / 1e12:.2f} T (ratio {ratio:.3f}; attention {at_compiled.attention / 1e12:.2f} T "
          f"of it, which XLA:CPU's tile loops hide from the HLO count); XLA cost_analysis {xla_flops / 1e12:.2f} T "
          "(counts each loop body once)")
    if abs(ratio - 1) > 0.10:
      raise SystemExit(f"{name}: compiled and analytic FLOPs differ by {abs(ratio - 1):.0%} (more than 10 %)")
    print(f"model FLOPs per sample (MFU's numerator, no recomputation): {at_compiled.model / 1e12:.2f} T; "
          f"forward {at_compiled.forward / 1e12:.2f} T")

    state, memory = result["state"], result["memory"]
    fsdp = result["mesh"]["fsdp"]
    print(f"per device (fsdp={fsdp}): parameters {state['params'] / gib:.2f} GiB trained + {state['frozen'] / gib:.2f} "
          f"GiB frozen, gradients {state['params'] / gib:.2f} GiB (f32, sharded like the parameters), Adam "
          f"{state['opt_state'] / gib:.2f} GiB, EMA {state['ema_params'] / gib:.2f} GiB; XLA:CPU's peak "
          f"{memory['total'] / gib:.1f} GiB (temporaries {memory['temp'] / gib:.1f})")
    summary = result["collectives"]
    gathered = summary.get("all-gather", {}).get("buffer_bytes", 0)
    reduced = summary.get("all-reduce", {}).get("buffer_bytes", 0)
    print(f"FSDP communication per step and device (compiled HLO, XLA:CPU): all-gather {gathered / gib:.1f} GiB "
          f"(f32 weights), all-reduce {reduced / gib:.1f} GiB (f32 gradients), sent "
          f"{sum(r['sent_bytes'] for r in summary.values()) / gib:.1f} GiB of which across nodes "
          f"{sum(r['sent_bytes_inter_node'] for r in summary.values()) / gib:.1f} GiB")

    # Tokens of the real length mix and what they cost.
    named, real = layouts(model)
    costs = {key: train_flops_per_sample(model, layout) for key, layout in named.items()}
    print(f"tokens per sample (length mix: mean real {real:.0f}): " + ", ".join(
        f"{key} {layout.row_tokens:.0f} ({costs[key].hardware / 1e12:.2f} TFLOP)" for key, layout in named.items())
          + f"; FLOP ratio padded/packed {costs['padded'].hardware / costs['packed'].hardware:.2f}x, "
          f"padded/best-fit {costs['padded'].hardware / costs['best-fit'].hardware:.2f}x")

    # The step on N GPUs, at the config's packing (what ejax runs).
    flops = costs["packed"]
    compute = flops.hardware * per_device / MATMUL_RATE
    print(f"{'GPUs':>5} | {'compute s':>9} | {'NVLink s':>8} | {'IB s':>6} | {'step s':>6} | {'serial s':>8} | "
          f"{'samples/s':>9} | {'MFU':>5}")
    for gpus in GPUS:
      nvlink, infiniband, _ = collective_seconds(result["collective_ops"], gpus)
      step = max(compute, nvlink, infiniband)
      rate = per_device * gpus / step
      mfu = flops.model * rate / (gpus * PEAK)
      print(f"{gpus:>5} | {compute:9.3f} | {nvlink:8.3f} | {infiniband:6.3f} | {step:6.3f} | "
            f"{compute + nvlink + infiniband:8.3f} | {rate:9.0f} | {mfu:5.1%}")
      if name == "GR00T-N1.5" and gpus == 1024:
        groot_round = (config, rate, step)

  config, rate, step = groot_round
  samples = config.train.steps * config.train.global_batch_size
  seconds = samples / rate
  seed_rate = samples / (SEED_MINUTES * 60) / 1024
  print(f"GR00T-N1.5 round on 1,024 H100s: {seconds:.0f} s predicted for {samples / 1e6:.2f}M samples "
        f"(configs/groot.py: {config.train.steps:,} steps x {config.train.global_batch_size}; the seed does not "
        f"publish its round's sample count) vs the seed's {SEED_MINUTES:.0f} min ({SEED_MINUTES * 60 / seconds:.0f}x; "
        f"the same samples in 22 min would be {seed_rate:.1f} samples/s a GPU against {rate / 1024:.0f} predicted)")


if __name__ == "__main__":
  main()
