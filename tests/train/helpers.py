"""Small, fast training configs shared by the trainer tests."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(path: str, arg: str | None = None):
  from ejax.train.compile_report import load_config_file  # the config as ejax.main resolves it
  return load_config_file(os.path.join(REPO, path), arg)


def train_on_example(config, steps: int, *, read_before=None, mesh_shape=(1, 1, 1), accum: int = 1,
                     samples: int = 4):
  """The trainer's state and jitted step for `config`, trained `steps` steps on its model's example batch
  (`samples` samples, in `accum` micro-batches) on a (data, fsdp, tensor) mesh of this process's devices.
  read_before(state): what to keep of the first state (the step donates it). Returns (what read_before
  gave, the last state, the state's shardings, the losses)."""
  import jax
  import numpy as np

  from ejax.models.registry import get_model_spec
  from ejax.parallel import global_batch, make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import create_train_state, model_parts
  from ejax.train.step import jit_train_step, make_train_step, train_state
  data, fsdp, tensor = mesh_shape
  mesh = make_mesh(dict(data=data, fsdp=fsdp, tensor=tensor), devices=jax.devices()[:data * fsdp * tensor])
  rules = [tuple(r) for r in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  example = get_model_spec(config.model.name).example_batch(config.model, samples, 0)
  arrays = {k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}
  if accum > 1:
    arrays = {k: v.reshape((accum, -1) + v.shape[1:]) for k, v in arrays.items()}
  state, shardings = create_train_state(config.model, config.train, tx, mesh, rules, seed=0)
  kept = read_before(state) if read_before else None
  batch = global_batch(arrays, mesh, rules, batch_axis=int(accum > 1))
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train), shardings,
                        jax.tree.map(lambda x: x.sharding, batch), mesh)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return kept, train_state(state), shardings, losses


def tiny_config(steps: int = 4, batch: int = 16, mesh=(-1, 1, 1)):
  """configs/tiny.py:runlocal shrunk further: fp32, logged every step, no side outputs."""
  config = load_config("configs/tiny.py", "runlocal")
  config.model.width, config.model.depth, config.model.num_heads = 32, 2, 4
  config.train.steps, config.train.global_batch_size = steps, batch
  config.train.compute_dtype = "float32"
  config.train.warmup_fraction = 0.25
  config.metrics.log_every_steps = 1
  config.metrics.tensorboard = False
  config.metrics.progress_bar = False
  config.checkpoint.every_steps = 1000
  config.checkpoint.async_save = False
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.compilation_cache_dir = ""  # keep the test session's cache (tests/conftest.py)
  return config


def variables(tree):
  """[(path, nnx.Variable)] of a state of nnx Variables."""
  import jax
  from flax import nnx
  return [(jax.tree_util.keystr(path), variable) for path, variable in
          jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(variable, nnx.Variable)]


def leaves(tree):
  """{path: array} of a state of nnx Variables."""
  import numpy as np
  return {path: np.asarray(variable.get_value()) for path, variable in variables(tree)}


def tables(tree):
  """{path: array} of the embodiment tables in a state of nnx Variables."""
  import numpy as np

  from ejax.parallel.axes import EMBODIMENT
  from ejax.parallel.params import variable_axis_names
  return {path: np.asarray(variable.get_value()) for path, variable in variables(tree)
          if (variable_axis_names(variable) or (None,))[0] == EMBODIMENT}


def groot_steps(steps: int = 2, **train):
  """configs/groot.py:runlocal (2 embodiment slots) trained `steps` steps on its example batch of 4
  samples, all of robot 1, with `train` set in config.train. Returns (the embodiment tables before,
  the state, the last step's metrics)."""
  import jax
  import numpy as np

  from ejax.models.registry import get_model_spec
  from ejax.parallel import global_batch, make_mesh
  from ejax.train.optim import make_optimizer
  from ejax.train.state import create_train_state, model_parts
  from ejax.train.step import jit_train_step, make_train_step, train_state
  config = load_config("configs/groot.py", "runlocal,dataset=synthetic")
  config.train.update(learning_rate=1e-2, warmup_fraction=0.0)
  config.train.update(train)
  mesh = make_mesh(dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  rules = [tuple(r) for r in config.sharding_rules]
  tx, schedule = make_optimizer(config.train)
  example = get_model_spec("groot").example_batch(config.model, 4, 0)
  arrays = {k: v for k, v in example.items() if isinstance(v, np.ndarray) and v.dtype != object}
  arrays["embodiment_id"] = np.ones_like(arrays["embodiment_id"])  # every sample is robot 1
  state, shardings = create_train_state(config.model, config.train, tx, mesh, rules, seed=0)
  before = tables(state.params)
  accum = int(config.train.grad_accum_steps)
  if accum > 1:  # micro-batches stacked on axis 0, as ejax/train/inputs.py stacks them
    arrays = {k: v.reshape((accum, -1) + v.shape[1:]) for k, v in arrays.items()}
  batch = global_batch(arrays, mesh, rules, batch_axis=int(accum > 1))
  step = jit_train_step(make_train_step(model_parts(config.model), tx, schedule, config.train), shardings,
                        jax.tree.map(lambda x: x.sharding, batch), mesh)
  for _ in range(steps):
    state, metrics = step(state, batch)
  return before, train_state(state), metrics


# The session's shared small GR00T checkpoint (tests/conftest.py: groot_sft_checkpoint): scripted
# demos of one ejax.sim task at 32 px (runlocal GR00T's vision size: no resize), configs/groot.py:
# runlocal trained 2 steps, max_action_dim 6 so that the chain has padded action dims (the env's
# actions are 4-d).
SFT_TASK = "goal_lift_green_block"
SFT_IMAGE_SIZE = 32
SFT_MAX_ACTION_DIM = 6


def groot_sim_checkpoint(root, *, task: str, image_size: int, episodes: int = 2, steps: int = 2,
                         max_action_dim: int | None = None) -> str:
  """A small GR00T checkpoint of the train job: scripted demos of one ejax.sim task recorded at
  image_size (runlocal's vision size, 32, needs no resize), then configs/groot.py:runlocal trained on
  them for `steps` steps. -> its checkpoint directory (root/sft/checkpoints)."""
  from ejax.sim import demos
  from ejax.train.loop import train
  config = load_config("configs/demos.py", f"runlocal,tasks={task},episodes={episodes},size={image_size}")
  config.demos.num_envs = episodes
  demos.run_job(config, os.path.join(root, "demos"))
  config = load_config("configs/groot.py", f"runlocal,dataset={os.path.join(root, 'demos', 'dataset')},steps={steps},batch=8")
  if max_action_dim is not None:
    config.model.max_action_dim = max_action_dim
  config.metrics.update(tensorboard=False, progress_bar=False)
  config.checkpoint.update(async_save=False, every_steps=steps)
  config.compilation_cache_dir = ""  # keep the tests' own compilation cache (tests/conftest.py)
  train(config, os.path.join(root, "sft"))
  return os.path.join(root, "sft", "checkpoints")


def losses(result) -> list[float]:
  return [entry["loss"] for entry in result["history"]]
