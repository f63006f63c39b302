"""A small flow-matching transformer policy: the trainer's default until a VLA is configured.

It is a real policy, not a placeholder: a bidirectional transformer over one state token, one task
token and `horizon` noisy-action tokens, trained with the GR00T flow-matching convention (t = 0 is
noise, t = 1 is data) and sampled with Euler steps. It is small enough to train on a CPU in
minutes, and it exercises the same trainer, sharding rules, attention op and checkpoints as the
full models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from ejax.kernels.attention import attention
from ejax.models.registry import ModelSpec
from ejax.parallel import axes as ax
from ejax.parallel import constrain, remat_policy


def default_config() -> ConfigDict:
  return ConfigDict(dict(
      name="tiny_flow", width=128, depth=4, num_heads=4, mlp_ratio=4, state_dim=8, action_dim=7,
      horizon=16, num_tasks=8, num_inference_steps=4, remat="none", attention_impl="auto"))


def _dense(in_features, out_features, axes, rngs, zero=False):
  init = nnx.initializers.zeros_init() if zero else nnx.initializers.lecun_normal()
  return nnx.Linear(in_features, out_features, rngs=rngs,
                    kernel_init=nnx.with_partitioning(init, axes),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)))


def _norm(width, rngs):
  return nnx.LayerNorm(width, rngs=rngs,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (ax.NORM,)),
                       bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (ax.NORM,)))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    width, heads = cfg.width, cfg.num_heads
    self.num_heads, self.head_dim, self.impl = heads, width // heads, cfg.attention_impl
    self.norm1, self.norm2 = _norm(width, rngs), _norm(width, rngs)
    self.qkv = _dense(width, 3 * width, (ax.EMBED, ax.HEADS), rngs)
    self.out = _dense(width, width, (ax.HEADS, ax.EMBED), rngs)
    self.up = _dense(width, cfg.mlp_ratio * width, (ax.EMBED, ax.MLP), rngs)
    self.down = _dense(cfg.mlp_ratio * width, width, (ax.MLP, ax.EMBED), rngs)

  def __call__(self, x):  # x [b, l, width]
    b, l, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, l, 3 * self.num_heads, self.head_dim), 3, axis=2)
    x = x + self.out(attention(q, k, v, impl=self.impl).reshape(b, l, -1))
    x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
    return constrain(x, ax.BATCH_SPEC)


def timestep_embedding(t: jax.Array, width: int) -> jax.Array:
  """Sinusoidal embedding of t in [0, 1] (scaled x1000 as GR00T buckets it)."""
  half = width // 2
  freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(half) / half)
  angles = (t * 1000.0)[..., None] * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class TinyFlowPolicy(nnx.Module):
  """velocity = f(noisy action chunk, t | state, task)."""

  def __init__(self, cfg: ConfigDict, rngs: nnx.Rngs):
    self.cfg = cfg
    w = cfg.width
    self.state_in = _dense(cfg.state_dim, w, (ax.IN_FEATURES, ax.EMBED), rngs)
    self.action_in = _dense(cfg.action_dim, w, (ax.IN_FEATURES, ax.EMBED), rngs)
    self.time_in = _dense(w, w, (ax.EMBED, ax.MLP), rngs)
    self.task_embed = nnx.Embed(cfg.num_tasks, w, rngs=rngs,
                                embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), (ax.VOCAB, ax.EMBED)))
    self.position = nnx.Param(jax.random.normal(rngs.params(), (cfg.horizon + 2, w)) * 0.02,
                              out_sharding=(None, ax.EMBED))
    policy = remat_policy(cfg.remat)
    block = Block if cfg.remat == "none" else nnx.remat(Block, policy=policy)
    self.blocks = nnx.List([block(cfg, rngs) for _ in range(cfg.depth)])
    self.final_norm = _norm(w, rngs)
    self.action_out = _dense(w, cfg.action_dim, (ax.EMBED, ax.IN_FEATURES), rngs, zero=True)

  def velocity(self, noisy_actions, t, state, task_id):
    """noisy_actions [b, h, a], t [b], state [b, s], task_id [b] -> velocity [b, h, a]."""
    time = self.time_in(timestep_embedding(t, self.cfg.width))[:, None]
    tokens = jnp.concatenate([
        self.state_in(state)[:, None],
        self.task_embed(task_id)[:, None],
        self.action_in(noisy_actions) + jax.nn.silu(time),
    ], axis=1) + self.position[None]
    x = constrain(tokens, ax.BATCH_SPEC)
    for block in self.blocks:
      x = block(x)
    return self.action_out(self.final_norm(x[:, 2:])).astype(jnp.float32)

  def compute_loss(self, batch, rng):
    actions = batch["action"].astype(jnp.float32)
    valid = 1.0 - batch["action_is_pad"].astype(jnp.float32)  # [b, h]
    noise_rng, time_rng = jax.random.split(rng)
    noise = jax.random.normal(noise_rng, actions.shape)
    # GR00T's schedule: t = (0.999 - s) / 0.999 with s ~ Beta(1.5, 1): more weight near noise.
    # Beta(a, 1) has CDF x**a, so u**(1/a) samples it exactly without a rejection loop.
    s = jax.random.uniform(time_rng, (actions.shape[0],)) ** (1.0 / 1.5)
    t = (0.999 - s) / 0.999
    noisy = (1.0 - t)[:, None, None] * noise + t[:, None, None] * actions
    target = actions - noise
    dtype = batch["observation.state"].dtype
    predicted = self.velocity(noisy.astype(dtype), t, batch["observation.state"], batch["task_index"])
    squared = jnp.mean(jnp.square(predicted - target), axis=-1)  # [b, h]
    per_sample = jnp.sum(squared * valid, axis=-1) / jnp.maximum(jnp.sum(valid, axis=-1), 1.0)
    return jnp.mean(per_sample), {"per_sample_loss": per_sample}

  def sample_actions(self, batch, rng, *, noise=None, num_steps=None):
    num_steps = num_steps or self.cfg.num_inference_steps
    b = batch["observation.state"].shape[0]
    x = jax.random.normal(rng, (b, self.cfg.horizon, self.cfg.action_dim)) if noise is None else noise
    dt = 1.0 / num_steps
    for i in range(num_steps):
      t = jnp.full((b,), i * dt)
      x = x + dt * self.velocity(x, t, batch["observation.state"], batch["task_index"])
    return x


def example_batch(cfg: ConfigDict, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "observation.state": rng.standard_normal((batch_size, cfg.state_dim)).astype(np.float32),
      "task_index": rng.integers(0, cfg.num_tasks, (batch_size,)).astype(np.int32),
      "action": rng.standard_normal((batch_size, cfg.horizon, cfg.action_dim)).astype(np.float32),
      "action_is_pad": np.zeros((batch_size, cfg.horizon), bool),
  }


SPEC = ModelSpec(create=TinyFlowPolicy, example_batch=example_batch)
