"""Meshes, logical-axis sharding rules, multi-host start-up and per-process data."""

from flax import nnx

# ejax's parameters carry logical axis names and are placed by jit out_shardings (ejax/train/state.py);
# flax's eager sharding would instead demand a mesh wherever a model is created (an abstract one in
# a plain script included). Every model module imports this package for its axis names, so this
# holds for `ejax.models.*` used on their own too.
nnx.use_eager_sharding(False)

from ejax.parallel.axes import *  # noqa: F401,F403  (the axis vocabulary)
from ejax.parallel.data import batch_sharding, global_batch, process_batch_size, replicated
from ejax.parallel.distributed import barrier, broadcast_flag, initialize as initialize_distributed
from ejax.parallel.mesh import MeshError, make_mesh, resolve_mesh_shape
from ejax.parallel.params import bytes_per_device, tree_shardings, variable_axis_names
from ejax.parallel.remat import remat_policy
from ejax.parallel.rules import constrain, current_context, logical_to_spec, sharding_context
