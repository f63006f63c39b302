"""Policy serving: chunks per second and latency through the websocket server against in-process calls.

The policy is GR00T runlocal (configs/groot.py:runlocal, the quickstart's architecture: two 64x64
cameras resized to 32, 11-d state, instruction), freshly initialised: speed does not depend on the
weights (--checkpoint=DIR serves a trained one instead). Served arm: C clients (1, 4, 16), each on
its own websocket connection sending one observation at a time and waiting for its chunk, as robots
do, through ejax/serve (msgpack, dynamic batching up to 16, every batch size compiled beforehand).
In-process arm: the same policy's act() on batches of C observations, back to back (the ceiling:
no network, no serialisation, no waiting for a batch to fill). At 16 clients the two arms alternate
in rounds so that load from other processes falls on both alike.

Run:  python benchmarks/serve.py        (no arguments; about a minute and a half on 2 CPU cores)
Goal: served/in-process chunks per second at 16 clients >= 0.8x.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import groot as groot_config  # noqa: E402
from ejax.models.registry import get_model_spec  # noqa: E402
from ejax.serve.client import Connection  # noqa: E402
from ejax.serve.server import PolicyServer  # noqa: E402
from ejax.serve.spec import NOISE_KEY, PROMPT_KEY  # noqa: E402
from ejax.train.policy import CheckpointPolicy, load_policy  # noqa: E402

GOAL = 0.8
nnx.use_eager_sharding(False)


def make_policy(checkpoint: str) -> CheckpointPolicy:
  if checkpoint:
    return load_policy(checkpoint)
  config = groot_config.get_config("runlocal")
  model = get_model_spec(config.model.name).create(config.model, nnx.Rngs(0))
  return CheckpointPolicy(model, config, norm_stats=None)


def observations(spec, count: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  result = []
  for _ in range(count):
    obs = {}
    for key, field in spec.fields.items():
      if field.dtype == "str":
        obs[key] = spec.example_prompt
      elif field.dtype == "uint8":
        obs[key] = rng.integers(0, 256, field.shape, dtype=np.uint8)
      else:
        obs[key] = rng.normal(0.0, 0.3, field.shape).astype(field.dtype)
    result.append(obs)
  return result


def in_process_round(policy, requests: list[dict], seconds: float) -> tuple[int, list[float], float]:
  """act() on the whole batch, back to back. -> (chunks, per-call latencies, wall seconds)."""
  batch = {key: np.stack([r[key] for r in requests]) for key in requests[0] if key != PROMPT_KEY}
  noise = np.zeros((len(requests), *policy.noise_shape), np.float32)
  instructions = [r[PROMPT_KEY] for r in requests]
  latencies, start = [], time.perf_counter()
  while time.perf_counter() - start < seconds:
    begin = time.perf_counter()
    policy.act(batch, instructions, jax.random.key(0), noise=noise)
    latencies.append(time.perf_counter() - begin)
  return len(latencies) * len(requests), latencies, time.perf_counter() - start


def served_round(connections: list[Connection], requests: list[dict], seconds: float) -> tuple[int, list[float], float]:
  """Every client in closed loop for `seconds`. -> (chunks, per-request latencies, wall seconds)."""
  latencies: list[list[float]] = [[] for _ in connections]
  barrier = threading.Barrier(len(connections) + 1)
  deadline = [0.0]

  def client(index: int) -> None:
    barrier.wait()
    while time.perf_counter() < deadline[0]:
      begin = time.perf_counter()
      connections[index].infer(requests[index])
      latencies[index].append(time.perf_counter() - begin)

  threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(connections))]
  for thread in threads:
    thread.start()
  start = time.perf_counter()
  deadline[0] = start + seconds
  barrier.wait()
  for thread in threads:
    thread.join()
  flat = [latency for per_client in latencies for latency in per_client]
  return len(flat), flat, time.perf_counter() - start


def summarise(name: str, chunks: int, latencies: list[float], seconds: float) -> float:
  rate = chunks / seconds
  p50, p99 = (1000.0 * np.percentile(latencies, q) for q in (50, 99))
  print(f"{name:<28} {p50:>9.1f} {p99:>9.1f} {rate:>10.1f}", flush=True)
  return rate


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
  parser.add_argument("--seconds", type=float, default=6.0, help="per measurement round")
  parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each arm at the largest count")
  parser.add_argument("--max_wait_ms", type=float, default=5.0)
  parser.add_argument("--checkpoint", default="", help="serve this train-job checkpoint instead of a fresh model")
  args = parser.parse_args()

  start = time.perf_counter()
  policy = make_policy(args.checkpoint)
  most = max(args.clients)
  server = PolicyServer(policy, port=0, max_batch=most, max_wait_ms=args.max_wait_ms).start()
  server.batcher.warmup()  # every bucket compiled: neither arm compiles while measured
  requests = observations(server.spec, most)
  for request in requests:
    request[NOISE_KEY] = np.zeros(policy.noise_shape, np.float32)
  print(f"GR00T runlocal{' from ' + args.checkpoint if args.checkpoint else ''}, {jax.devices()[0].platform}; "
        f"buckets {server.batcher.buckets} compiled in {time.perf_counter() - start:.0f} s", flush=True)
  print(f"{'arm':<28} {'p50 ms':>9} {'p99 ms':>9} {'chunks/s':>10}", flush=True)

  connections = [Connection(f"127.0.0.1:{server.port}") for _ in range(most)]
  rates = {}
  try:
    for count in args.clients:
      rounds = args.rounds if count == most else 1
      totals = {"in-process": [0, [], 0.0], "served": [0, [], 0.0]}
      for _ in range(rounds):
        for arm, measure in (("in-process", lambda: in_process_round(policy, requests[:count], args.seconds)),
                             ("served", lambda: served_round(connections[:count], requests[:count], args.seconds))):
          chunks, latencies, seconds = measure()
          totals[arm][0] += chunks
          totals[arm][1] += latencies
          totals[arm][2] += seconds
      for arm, (chunks, latencies, seconds) in totals.items():
        label = f"{arm}, {count} client{'s' if count > 1 else ''}" if arm == "served" else f"{arm}, batch {count}"
        rates[(arm, count)] = summarise(label, chunks, latencies, seconds)
  finally:
    for connection in connections:
      connection.close()
    server.stop()
  sizes = server.batcher.batch_sizes
  print(f"served batches: {len(sizes)}, mean size {np.mean(sizes):.1f}; total {time.perf_counter() - start:.0f} s")
  ratio = rates[("served", most)] / rates[("in-process", most)]
  # The in-process arm does the same work with no network, serialisation or batch filling: 1.0x is
  # the most serving can reach.
  print(f"served/in-process chunks per second at {most} clients: {ratio:.2f}x of a possible 1.00x (goal {GOAL}x)")


if __name__ == "__main__":
  main()
