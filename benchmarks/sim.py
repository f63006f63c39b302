"""Simulation throughput: env steps per second, MJX vs native MuJoCo, with and without cameras.

    python benchmarks/sim.py            # CPU, a few minutes (mostly MJX compilation)
    python benchmarks/sim.py --gpu      # also larger MJX batches (on a GPU machine)

Every env runs a task from all 15 (mixed in one batch), random actions, 10 Hz control with 10
physics substeps per env step. Compilation and the first steps are excluded (two warm-up steps:
a jitted function fed its own output compiles once more). Cameras: both views at 64x64 RGB + depth.
The "cameras" column says who casts the rays: "jax" (camera.render, JAX on the host: the MJX backend's
and formerly the native backend's) or "mujoco" (the native backend's default: MuJoCo's mj_multiRay in
C on the candidate pixels, shaded in JAX; raycast_native.py).

Prints one row per configuration, the native/mjx ratio without cameras, then the native backend's two
camera paths side by side: the same envs, seed and actions, timed in alternating rounds so that load
from other processes falls on both alike. Ends with that headline ratio.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

from ejax.sim import env as env_lib
from ejax.sim import registry
from ejax.sim.batched import make_batched
from ejax.sim.native import NativeBatchedEnv

IMAGE_SIZE = (64, 64)


def make_env(backend: str, num_envs: int, renderer: str | None, tasks: int | None = None):
  """renderer None: no cameras; "jax" / "mujoco": who casts the camera rays (mujoco: native only).
  tasks: the first that many of the 15 (None: all)."""
  names = registry.list_tasks()[:tasks]
  if backend == "native" and renderer is not None:
    return NativeBatchedEnv(names, num_envs, cameras=True, image_size=IMAGE_SIZE, episode_length=10_000,
                            camera_renderer=renderer)
  return make_batched(names, num_envs, backend=backend, cameras=renderer is not None, image_size=IMAGE_SIZE,
                      episode_length=10_000)


class Runner:
  """One env stepped with a fixed action sequence; `run(steps)` returns the wall time of those steps."""

  def __init__(self, env, seed: int = 0):
    self.env = env
    self.state = env.reset(jax.random.key(seed))
    self._actions = np.random.default_rng(seed).uniform(-1, 1, (64, env.num_envs, 4)).astype(np.float32)
    self._step = 0
    self.run(2)  # warm-up: compilation, and the recompilation a jitted function fed its own output does

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.state = self.env.step(self.state, self._actions[self._step % len(self._actions)])
      self._step += 1
    jax.block_until_ready(self.state)
    return time.perf_counter() - start


def measure(backend: str, num_envs: int, renderer: str | None, steps: int, tasks: int | None = None) -> float:
  runner = Runner(make_env(backend, num_envs, renderer, tasks))
  return num_envs * steps / runner.run(steps)


def compare_native_cameras(num_envs: int, steps: int, rounds: int,
                           tasks: int | None = None) -> tuple[float, float, float]:
  """(new, old) env-steps/s of the native backend with cameras, and the fraction of identical pixels.

  Both runners get the same seed and actions, so they simulate the same states; `rounds` alternating
  rounds of `steps` steps each."""
  new, old = Runner(make_env("native", num_envs, "mujoco", tasks)), Runner(make_env("native", num_envs, "jax", tasks))
  new_time = old_time = 0.0
  for _ in range(rounds):
    new_time += new.run(steps)
    old_time += old.run(steps)
  same = [np.mean(np.all(new.state.obs[key] == old.state.obs[key], axis=-1))
          for key in (f"observation.images.{name}" for name in env_lib.CAMERA_NAMES)]
  total = num_envs * steps * rounds
  return total / new_time, total / old_time, float(np.mean(same))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", action="store_true", help="add MJX batch sizes that only make sense on a GPU")
  parser.add_argument("--camera-envs", type=int, default=64, help="batch of the native camera comparison")
  parser.add_argument("--camera-steps", type=int, default=2, help="steps per round of the camera comparison")
  parser.add_argument("--camera-rounds", type=int, default=8, help="alternating rounds of the camera comparison")
  parser.add_argument("--quick", action="store_true", help="only the batch-64 pair the ratio needs, few steps (tests)")
  parser.add_argument("--tasks", type=int, default=None,
                      help="the first N of the 15 tasks (default all; tests: fewer branches to compile)")
  args = parser.parse_args()
  device = jax.devices()[0]
  print(f"# ejax.sim throughput, {device.platform} ({device.device_kind}), {platform.node()}, "
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
  configurations = [
      ("native", 16, None, 20), ("native", 64, None, 10), ("native", 256, None, 4),
      ("native", 64, "mujoco", 10),
      ("mjx", 64, None, 10), ("mjx", 256, None, 4), ("mjx", 64, "jax", 4),
  ]
  if args.gpu:  # the GPU's batches first: the window's time limit cut them off when they came last
    configurations = [("mjx", 4096, None, 10), ("mjx", 1024, None, 20), ("mjx", 1024, "jax", 5)] + configurations
  if args.quick:
    configurations = [("native", 64, None, 2), ("mjx", 64, None, 2)]
  results = {}
  print(f"{'backend':<8} {'envs':>6} {'cameras':>8} {'env-steps/s':>12}")
  for backend, num_envs, renderer, steps in configurations:
    rate = measure(backend, num_envs, renderer, steps, args.tasks)
    results[(backend, num_envs, renderer)] = rate
    print(f"{backend:<8} {num_envs:>6} {renderer or 'none':>8} {rate:>12.0f}", flush=True)
  ratio = results[("native", 64, None)] / results[("mjx", 64, None)]
  print(f"native/mjx env-steps/s at batch 64 without cameras ({device.platform}): {ratio:.2f}x (goal >= 2x on CPU)")

  new, old, same = compare_native_cameras(args.camera_envs, args.camera_steps, args.camera_rounds, args.tasks)
  print(f"native {args.camera_envs} envs, cameras {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} x {len(env_lib.CAMERA_NAMES)}, "
        f"{args.camera_rounds} alternating rounds of {args.camera_steps} steps: mujoco (new) {new:.0f}, "
        f"jax (old) {old:.0f} env-steps/s; identical pixels in the last images {same:.2%}", flush=True)
  # Bound: cameras that cost nothing, i.e. the native backend's rate without cameras at this batch.
  bare = results.get(("native", args.camera_envs, None)) or measure("native", args.camera_envs, None, 10, args.tasks)
  print(f"native camera env-steps/s new/old: {new / old:.2f}x of a possible {bare / old:.2f}x "
        f"(cameras free: native without cameras / old) (goal 5x)")


if __name__ == "__main__":
  main()
