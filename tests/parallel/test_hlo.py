"""Reading compiled HLO: matmul FLOPs and collectives per call, loops counted as often as they run."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ejax.parallel import make_mesh
from ejax.parallel.hlo import _replica_groups, collective_summary, collectives, matmul_flops
from ejax.train.metrics import compiled_flops


def _layers(w, x):
  return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0].sum()


def test_matmul_flops_count_every_iteration_of_a_scan():
  layers, rows, width = 6, 64, 128
  compiled = jax.jit(_layers).lower(jax.ShapeDtypeStruct((layers, width, width), jnp.float32),
                                    jax.ShapeDtypeStruct((rows, width), jnp.float32)).compile()
  expected = 2 * rows * width * width * layers
  assert matmul_flops(compiled.as_text()) == expected
  assert compiled_flops(compiled) == expected  # what the trainer's mfu divides by
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  assert xla["flops"] < expected / 2  # XLA's own count sees the loop body once


def test_collectives_of_a_sharded_scan():
  mesh = make_mesh(dict(data=2, fsdp=4, tensor=1))
  layers, rows, width = 3, 16, 64
  # Weights sharded over fsdp (gathered in every layer), rows over data x fsdp: an FSDP step.
  w = jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
  x = jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
  text = jax.jit(jax.grad(_layers)).lower(w, x).compile().as_text()
  found = collectives(text, mesh.size, node_size=4)
  gathers = [c for c in found if c.kind == "all-gather"]
  assert gathers and all(c.group_size == 4 and not c.crosses_nodes for c in gathers)
  # Each layer's weight is gathered inside the loop: once per layer at least.
  assert sum(c.count for c in gathers) >= layers
  assert max(c.buffer_bytes for c in gathers) == width * width * 4
  summary = collective_summary(found)
  reduced = summary.get("all-reduce", summary.get("reduce-scatter"))
  assert reduced is not None and reduced["count"] >= layers
  # The weight gradients are summed over the data axis too: across "nodes" of 4 devices here.
  assert any(c.crosses_nodes for c in found)
  np.testing.assert_allclose(summary["all-gather"]["sent_bytes"],
                             sum(c.count * 3 / 4 * c.buffer_bytes for c in gathers))


def test_replica_groups_in_every_spelling():
  # iota (jax 0.9.2's XLA), listed, and named mesh axes (jax 0.11's XLA): the same groups.
  by_fsdp = [[0, 1, 2, 3], [4, 5, 6, 7]]
  by_data = [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert _replica_groups("replica_groups=[2,4]<=[8], dimensions={0}", 8) == by_fsdp
  assert _replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == by_data
  assert _replica_groups("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 8) == by_fsdp
  assert _replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}", 8) == by_fsdp
  assert _replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add", 8) == by_data
  assert _replica_groups("replica_groups=mesh['axis_0'=8] {'axis_0'}, to_apply=%add", 8) == [list(range(8))]
  assert _replica_groups("channel_id=1, dimensions={0}", 4) == [[0, 1, 2, 3]]
