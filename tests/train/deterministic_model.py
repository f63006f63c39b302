"""A regression policy with a noise-free loss, for tests that need exact loss equality."""

import jax.numpy as jnp
from flax import nnx

from ejax.models import tiny
from ejax.models.registry import ModelSpec
from ejax.parallel import axes as ax


class MeanActionRegressor(nnx.Module):
  def __init__(self, cfg, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(cfg.state_dim, cfg.width, rngs=rngs,
                             kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (ax.IN_FEATURES, ax.MLP)))
    self.out = nnx.Linear(cfg.width, cfg.horizon * cfg.action_dim, rngs=rngs,
                          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (ax.MLP, ax.EMBED)))
    self.shape = (cfg.horizon, cfg.action_dim)

  def compute_loss(self, batch, rng):
    del rng
    predicted = self.out(jnp.tanh(self.hidden(batch["observation.state"]))).reshape((-1,) + self.shape)
    per_sample = jnp.mean(jnp.square(predicted - batch["action"]), axis=(1, 2))
    return jnp.mean(per_sample), {"per_sample_loss": per_sample}


SPEC = ModelSpec(create=MeanActionRegressor, example_batch=tiny.example_batch)
