"""How long one train-step call holds the host: on the TrainState, against on the state's leaves.

On the H200 of 2026-11-30 (evening) GR00T-N1.5's step call held the host 58.2 ms of its 78.2 ms
step, and pi0.5's 207.4 of 208.7: the step is the host's time. A TrainState is a tree of nnx.State
nodes, and a jitted call on one flattens its ~1,900 nnx Variables and builds them again for the
output in Python (the profile's host spans: flax's `_variable_unflatten` under the call). The train
step is therefore jitted over the leaves (ejax.train.step.jit_train_step: a FlatState goes back in).

This benchmark times both calls side by side on a config's full-size state structure, built from
shapes (nothing of model size is allocated: every leaf is a 4-element array of its dtype), with a
step that only adds one to each float leaf, so the device's work is nil and what is timed is the
call: flattening, the runtime's per-buffer work and building the output. The arms alternate call by
call; each figure is the median of --calls calls.

  python benchmarks/dispatch.py                                   # configs/groot.py, full size
  python benchmarks/dispatch.py --config configs/pi05.py

Last line: `train-step call on <device>, <config>'s state (<n> leaves): <a> ms on its leaves against
<b> ms on the TrainState: <b/a>x less (goal 3x)`. The bound is the leaves' own call, 1x of itself;
the goal says the nnx tree no longer dominates the call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOAL = 3.0


def build(config_arg: str):
  """(the TrainState of 4-element arrays, its replicated shardings, the batch, the mesh) for a config."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from ejax.parallel import make_mesh
  from ejax.train.compile_report import load_config_file
  from ejax.train.optim import make_optimizer
  from ejax.train.state import abstract_train_state

  path, _, arg = config_arg.partition(":")
  config = load_config_file(path, arg or None)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  tx, _ = make_optimizer(config.train)
  abstract, _ = abstract_train_state(config.model, config.train, tx, mesh, [tuple(r) for r in config.sharding_rules])
  replicated = NamedSharding(mesh, PartitionSpec())

  def tiny(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.device_put(jax.random.key(0), replicated)
    return jax.device_put(jnp.zeros((4,), leaf.dtype), replicated)

  state = jax.tree.map(tiny, abstract)
  shardings = jax.tree.map(lambda _: replicated, abstract)
  batch = {"x": jax.device_put(jnp.ones((4,), jnp.float32), replicated)}
  return state, shardings, batch, mesh


def touch(state, batch):
  """Adds one to each float leaf: a program with every buffer in and out, and no work to speak of."""
  import jax
  import jax.numpy as jnp

  def add(leaf):
    return leaf + batch["x"].astype(leaf.dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

  return jax.tree.map(add, state), {"loss": batch["x"].sum()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/groot.py", help="a config file[:arg]: its full state's structure")
  parser.add_argument("--calls", type=int, default=30, help="timed calls an arm (after 3 warm-up calls)")
  args = parser.parse_args(argv)

  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from ejax.train.step import jit_train_step

  state, shardings, batch, mesh = build(args.config)
  leaves = len(jax.tree.leaves(state))
  batch_shardings = jax.tree.map(lambda x: x.sharding, batch)
  on_tree = jax.jit(touch, in_shardings=(shardings, batch_shardings),
                    out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0,))
  on_leaves = jit_train_step(touch, shardings, batch_shardings, mesh)
  states = {"tree": state, "leaves": jax.tree.map(lambda x: x.copy(), state)}
  calls = {"tree": on_tree, "leaves": on_leaves}
  held = {"tree": [], "leaves": []}
  for i in range(args.calls + 3):
    for arm in ("leaves", "tree"):
      start = time.perf_counter()
      states[arm], metrics = calls[arm](states[arm], batch)
      took = time.perf_counter() - start
      jax.block_until_ready(metrics["loss"])
      if i >= 3:
        held[arm].append(took)
  tree_ms = 1e3 * statistics.median(held["tree"])
  leaves_ms = 1e3 * statistics.median(held["leaves"])
  ratio = tree_ms / leaves_ms
  device = jax.devices()[0].device_kind
  print(f"# {args.config}: {leaves} leaves, jax {jax.__version__}, {args.calls} calls an arm, arms alternating")
  print(f"  on the TrainState  {tree_ms:7.2f} ms a call (min {1e3 * min(held['tree']):.2f})")
  print(f"  on its leaves      {leaves_ms:7.2f} ms a call (min {1e3 * min(held['leaves']):.2f})")
  print(f"train-step call on {device}, {args.config}'s state ({leaves} leaves): {leaves_ms:.2f} ms on its leaves "
        f"against {tree_ms:.2f} ms on the TrainState: {ratio:.1f}x less (goal {GOAL:g}x)")
  return dict(config=args.config, leaves=leaves, tree_ms=tree_ms, leaves_ms=leaves_ms, ratio=ratio, device=device)


if __name__ == "__main__":
  main()
