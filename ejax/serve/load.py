"""What job `serve` serves, told apart by what `serve.checkpoint` holds on disk.

  train     a train job's <workdir>/checkpoints (numbered steps holding state/, data/, meta/): the
            model, its data config and normalisation statistics travel inside it.
  rl        an RL job's <workdir>/rl_checkpoints (numbered versions holding state/, metadata/) of a
            GR00T or pi0.5 actor (rl.policy.kind "groot" / "pi05"): served as the model policy it is, like its
            SFT train checkpoint (same observation spec and metadata), with the version's weights.
            The state-based actors (mlp_flow, tiny_flow) are refused: they read the simulator's
            privileged object state and a task index, which no robot or openpi client has; the
            eval job judges them (--config.eval.policy=rl).
  imported  released weights imported by the convert job (--config.convert.direction=import: one
            orbax tree of the model's parameters): built from the job's own config.model and
            config.data, with the statistics at config.data.stats_path (load_imported_policy).
A workdir holding one of the first two (checkpoints/ or rl_checkpoints/) stands for it; a numbered
step / version directory inside one picks that step (as serve.version does). All three load through
the eval job's loaders (ejax.train.policy.load_policy, ejax.rl.build.load_rl_policy) into the
same CheckpointPolicy, so the server treats them alike.
"""

from __future__ import annotations

import dataclasses
import os

from flax import nnx
from ml_collections import ConfigDict

from ejax.checkpoint import Checkpointer, CheckpointError
from ejax.checkpoint.kinds import IMPORTED, RL, TRAIN, checkpoint_kind, numbered

ACCEPTED = ("a train job's <workdir>/checkpoints, an rl job's <workdir>/rl_checkpoints (GR00T or pi0.5 actor), or weights "
            "imported by the convert job (--config.convert.direction=import)")
STATE_BASED_KINDS = ("mlp_flow", "tiny_flow")
VLA_KINDS = ("groot", "pi05")  # RL actors that are a train checkpoint's model (ejax.rl.vla, ejax.rl.vla_pi05)


@dataclasses.dataclass(frozen=True)
class Source:
  kind: str              # TRAIN | RL | IMPORTED
  path: str              # the checkpoints / rl_checkpoints / imported weights directory
  version: int | None    # the train step or RL version (imported weights have none)


def find_source(path: str, version: int = -1) -> Source:
  """The Source `path` holds (see the module docstring); version -1 picks the newest step / version.
  Anything else is a CheckpointError naming the path and the accepted kinds."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.exists(path):
    raise CheckpointError(f"serve.checkpoint {path} does not exist: point it at {ACCEPTED}")
  chosen = None if version < 0 else int(version)
  kind = checkpoint_kind(path)
  parent = os.path.dirname(path)
  if kind is None and os.path.basename(path).isdigit() and checkpoint_kind(parent) in (TRAIN, RL):
    step = int(os.path.basename(path))
    if chosen is not None and chosen != step:
      raise CheckpointError(f"serve.checkpoint {path} names step {step} but serve.version={chosen}: give one of them")
    kind, path, chosen = checkpoint_kind(parent), parent, step
  if kind is None:
    inside = [name for name in ("checkpoints", "rl_checkpoints") if checkpoint_kind(os.path.join(path, name))]
    if len(inside) > 1:
      raise CheckpointError(f"{path} holds both checkpoints/ and rl_checkpoints/: point serve.checkpoint at the one to serve")
    if inside:
      return find_source(os.path.join(path, inside[0]), -1 if chosen is None else chosen)
    raise CheckpointError(f"{path} is none of what job serve loads: point serve.checkpoint at {ACCEPTED}")
  if kind == IMPORTED:
    if chosen is not None:
      raise CheckpointError(f"imported weights {path} have no steps or versions: leave serve.version at -1")
    return Source(kind, path, None)
  saved = numbered(path)
  if chosen is not None and chosen not in saved:
    what = "step" if kind == TRAIN else "version"
    raise CheckpointError(f"{path} holds no {what} {chosen}; saved: {saved}")
  return Source(kind, path, saved[-1] if chosen is None else chosen)


def load_rl_groot_policy(directory: str, version: int | None = None):
  """An RL version of a GR00T or pi0.5 actor as the CheckpointPolicy of its SFT checkpoint with the
  version's model weights: the same observations, prompt and normalisation as the train checkpoint it started
  from, sampled with the RL policy's Euler steps (the eval job's policy=rl acts the same)."""
  from ejax.rl.checkpoint import RLCheckpointer
  from ejax.rl.build import load_rl_policy
  from ejax.train.policy import CheckpointPolicy
  from ejax.train.state import model_parts
  checkpointer = RLCheckpointer(directory)
  try:
    chosen = checkpointer.resolve_version(version)
    policy_config = ConfigDict(checkpointer.read_metadata(chosen).get("policy") or {})
  finally:
    checkpointer.close()
  kind = policy_config.get("kind")
  if kind not in VLA_KINDS:
    why = (" reads the simulator's privileged object state and a task index, which no robot or openpi client "
           "sends") if kind in STATE_BASED_KINDS else " is not a GR00T or pi0.5 actor"
    raise CheckpointError(f"RL version {chosen} in {directory} is an rl.policy.kind={kind!r} actor, which{why}: job "
                          "serve serves GR00T and pi0.5 actors (actor=groot|pi05); judge this one with --config.eval.policy=rl")
  rl_policy = load_rl_policy(directory, chosen)
  step = int(policy_config.get("step", -1))
  sft = Checkpointer(policy_config.checkpoint)
  try:
    meta = sft.read_meta(None if step < 0 else step)
  finally:
    sft.close()
  config = ConfigDict(meta["config"])
  config.model.num_inference_steps = int(rl_policy.policy.num_steps)
  model = nnx.merge(model_parts(config.model).graphdef, rl_policy.params["actor"][kind])
  return CheckpointPolicy(model, config, meta.get("norm_stats"))


def load_imported_policy(weights_dir: str, config: ConfigDict) -> CheckpointPolicy:
  """Released weights imported by the convert job (--config.convert.direction=import writes the
  model's parameters alone: no config, no statistics) as a policy. What a train checkpoint carries
  comes from `config` instead, as the train job would use it: the model from config.model; cameras,
  state key, image size and normalisation mode from config.data; the statistics from the stats.json
  at config.data.stats_path (the stats job writes one; LeRobot datasets ship meta/stats.json)."""
  from ejax.data.stats import load_stats
  from ejax.models.io.convert import restore_params
  from ejax.models.registry import get_model_spec
  from ejax.train.policy import CheckpointPolicy
  mode, stats_path = config.data.get("normalization", "none"), config.data.get("stats_path")
  norm_stats = None
  if mode != "none":
    if not stats_path or not os.path.isfile(stats_path):
      missing = f"data.stats_path={stats_path} does not exist" if stats_path else "no data.stats_path is set"
      raise CheckpointError(f"imported weights {weights_dir} carry no normalisation statistics and {missing}: pass "
                            "--config.data.stats_path=<stats.json> (the stats job writes one; a LeRobot dataset has "
                            "meta/stats.json), or data.normalization=none")
    norm_stats = load_stats(stats_path)
  config = get_model_spec(config.model.name).policy_config(config, norm_stats)
  try:
    model = restore_params(config.model, weights_dir)
  except (ValueError, KeyError, TypeError) as error:
    reason = " ".join(str(error).split()).split(". ")[0][:200]  # orbax goes on to list every key
    raise CheckpointError(f"weights in {weights_dir} do not fit config.model ({config.model.name}): {reason}; serve "
                          "them with the model config they were imported with", kind="layout") from None
  return CheckpointPolicy(model, config, norm_stats)


def load_served_policy(config: ConfigDict, workdir: str):
  """(the policy job `serve` serves, its Source): serve.checkpoint ("" : the workdir) through the
  loader of its kind, its weights optionally turned into block-FP8 values (serve.weights)."""
  from ejax.rl.inference import inference_weights
  from ejax.train.policy import load_policy
  serve = config.serve
  source = find_source(serve.checkpoint or workdir, int(serve.get("version", -1)))
  if source.kind == TRAIN:
    policy = load_policy(source.path, step=source.version)
  elif source.kind == RL:
    policy = load_rl_groot_policy(source.path, source.version)
  else:
    policy = load_imported_policy(source.path, config)
  transform = inference_weights(serve.weights, setting="serve.weights")
  if transform is not None:
    policy.map_weights(transform)
  return policy, source
