"""Building an RL run's parts from config: its env, its policy, and a saved policy version.

Shared by the rl job (ejax.rl.runner), the eval job (policy=rl) and the policy server, none of
which need the others to rebuild a policy.
"""

from __future__ import annotations

import os

from flax import nnx
from ml_collections import ConfigDict

from ejax.checkpoint import CheckpointError
from ejax.rl import warm_start
from ejax.rl.checkpoint import RLCheckpointer


def make_env(env_config: ConfigDict):
  """"point_reach" (ejax.rl.point_env) or any task name of ejax.sim.registry, with MJX physics
  (backend "mjx": one pure env the shards jit) or native MuJoCo (backend "native": ejax.rl.env_shard.NativeSimEnv)."""
  kwargs = dict(env_config.get("kwargs", {}))
  if env_config.name == "point_reach":
    from ejax.rl.point_env import PointReach
    return PointReach(**kwargs)
  from ejax.sim import registry
  if env_config.get("backend", "mjx") == "native":
    from ejax.rl.env_shard import NativeSimEnv
    registry.get_spec(env_config.name)  # an unknown task fails here, before any thread starts
    return NativeSimEnv(env_config.name, **kwargs)
  return registry.make(env_config.name, **kwargs)


def make_policy(policy_config: ConfigDict, seed: int):
  from ejax.rl import policy as policies
  rngs = nnx.Rngs(seed)
  if policy_config.kind == "mlp_flow":
    return policies.mlp_flow_policy(state_dim=policy_config.state_dim, action_dim=policy_config.action_dim,
                                    horizon=policy_config.horizon, num_tasks=policy_config.num_tasks,
                                    num_steps=policy_config.num_steps, hidden=policy_config.hidden, rngs=rngs,
                                    noise_level=policy_config.noise_level,
                                    noisy_steps=policy_config.get("noisy_steps", 0))
  if policy_config.kind == "tiny_flow":
    from ejax.models.tiny import default_config
    model_config = default_config()
    model_config.update(dict(policy_config.get("model", {})))
    return policies.tiny_flow_policy(model_config, rngs=rngs, value_hidden=policy_config.hidden,
                                     noise_level=policy_config.noise_level)
  if policy_config.kind in ("groot", "pi05"):
    # The SFT checkpoint (a train job's checkpoints dir) is the actor; its weights are version 0.
    from ejax.rl.vla import vla_flow_policy
    return vla_flow_policy(vla_kind(policy_config.kind), policy_config, rngs=rngs)
  raise ValueError(f"rl.policy.kind {policy_config.kind!r}: use 'mlp_flow', 'tiny_flow', 'groot' or 'pi05'")


def vla_kind(name: str):
  """The VlaKind of rl.policy.kind "groot" (ejax.rl.vla) or "pi05" (ejax.rl.vla_pi05)."""
  if name == "pi05":
    from ejax.rl.vla_pi05 import PI05
    return PI05
  from ejax.rl.vla import GROOT
  return GROOT


def load_rl_policy(checkpoint_dir: str, version: int = -1) -> "warm_start.EvalPolicy":
  """A saved RL policy version (-1: the newest) behind ejax.eval's policy interface. The policy is
  rebuilt from the config saved with it (a GR00T or pi0.5 actor: from the SFT checkpoint it names, which
  gives the architecture, tokenizer and normalisation), then takes the version's parameters."""
  if not os.path.isdir(checkpoint_dir):
    raise CheckpointError(f"RL checkpoint directory {checkpoint_dir} does not exist: point "
                          f"--config.eval.checkpoint at an rl run's <workdir>/rl_checkpoints")
  checkpointer = RLCheckpointer(checkpoint_dir)
  try:
    chosen = checkpointer.resolve_version(None if version < 0 else version)
    metadata = checkpointer.read_metadata(chosen)
    if not metadata.get("policy"):
      raise CheckpointError(f"RL checkpoint {checkpoint_dir} version {chosen} does not record its policy config")
    policy = make_policy(ConfigDict(metadata["policy"]), seed=0)
    params, _ = checkpointer.restore_params(policy.initial_params, chosen)
  finally:
    checkpointer.close()
  return warm_start.EvalPolicy(policy, params)
