"""Simulation throughput: env steps per second, MJX vs native MuJoCo, with and without cameras.

    python benchmarks/sim.py            # CPU, a few minutes (mostly MJX compilation)
    python benchmarks/sim.py --gpu      # also larger MJX batches (on a GPU machine)

Every env runs a task from all 15 (mixed in one batch), random actions, 10 Hz control with 10
physics substeps per env step. Compilation and the first steps are excluded (two warm-up steps:
a jitted function fed its own output compiles once more). Cameras: both views at 64x64 RGB, ray cast
in JAX. Prints one row per configuration and ends with the headline ratio.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

from ejax.sim import registry
from ejax.sim.batched import make_batched


def measure(backend: str, num_envs: int, cameras: bool, steps: int) -> float:
  env = make_batched(registry.list_tasks(), num_envs, backend=backend, cameras=cameras, image_size=(64, 64),
                     episode_length=10_000)
  rng = np.random.default_rng(0)
  actions = [rng.uniform(-1, 1, (num_envs, 4)).astype(np.float32) for _ in range(steps + 2)]
  state = env.reset(jax.random.key(0))
  for k in range(2):
    state = env.step(state, actions[k])
  jax.block_until_ready(state)
  start = time.perf_counter()
  for k in range(steps):
    state = env.step(state, actions[k + 2])
  jax.block_until_ready(state)
  return num_envs * steps / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", action="store_true", help="add MJX batch sizes that only make sense on a GPU")
  args = parser.parse_args()
  device = jax.devices()[0]
  print(f"# ejax.sim throughput, {device.platform} ({device.device_kind}), {platform.node()}, "
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
  configurations = [
      ("native", 16, False, 20), ("native", 64, False, 10), ("native", 256, False, 4),
      ("native", 64, True, 4),
      ("mjx", 64, False, 10), ("mjx", 256, False, 4), ("mjx", 64, True, 4),
  ]
  if args.gpu:
    configurations += [("mjx", 1024, False, 20), ("mjx", 4096, False, 10), ("mjx", 1024, True, 5)]
  results = {}
  print(f"{'backend':<8} {'envs':>6} {'cameras':>8} {'env-steps/s':>12}")
  for backend, num_envs, cameras, steps in configurations:
    rate = measure(backend, num_envs, cameras, steps)
    results[(backend, num_envs, cameras)] = rate
    print(f"{backend:<8} {num_envs:>6} {str(cameras):>8} {rate:>12.0f}", flush=True)
  ratio = results[("native", 64, False)] / results[("mjx", 64, False)]
  print(f"native/mjx env-steps/s at batch 64 without cameras ({device.platform}): {ratio:.2f}x (goal >= 2x on CPU)")


if __name__ == "__main__":
  main()
