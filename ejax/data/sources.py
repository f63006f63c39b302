"""The random-access sample source that config.data.name names (lerobot | rlds | sim_demos).

Its own module so that the pipeline and the stats job both open sources without importing each other.
"""

from __future__ import annotations

from ejax.data.source import DEFAULT_SKIP_LIMIT


def make_source(data_config):
  """The random-access sample source named by data.name."""
  name = data_config.get("name", "lerobot")
  path = data_config.get("path")
  if name == "sim_demos":
    # ejax.sim's scripted-expert demonstrations: a LeRobot v3 dataset, recorded on first use.
    from ejax.sim.demos import cached_dataset
    name, path = "lerobot", cached_dataset(data_config.sim_demos, path)
  common = dict(horizon=int(data_config.get("horizon", 16)),
                cameras=data_config.get("cameras", None),
                image_size=data_config.get("image_size", None),
                embodiment_id=data_config.get("embodiment_id", 0),
                on_bad_sample=data_config.get("on_bad_sample", "error"),
                skip_limit=int(data_config.get("skip_limit", DEFAULT_SKIP_LIMIT)))
  if name == "lerobot":
    from ejax.data.lerobot import DEFAULT_TOLERANCE_S, LeRobotSource
    return LeRobotSource(
        path, observation_offsets=tuple(data_config.get("observation_offsets", (0,))),
        state_key=data_config.get("state_key", "observation.state"),
        action_key=data_config.get("action_key", "action"),
        aux_keys=[data_config.aux_state_key] if data_config.get("aux_state_key", None) else [],
        raw_keys=[data_config.aux_pixel_key] if data_config.get("aux_pixel_key", None) else [],
        tolerance_s=float(data_config.get("tolerance_s", DEFAULT_TOLERANCE_S)),
        max_open_videos=int(data_config.get("max_open_videos", 32)), **common)
  if name == "rlds":
    from ejax.data.rlds import RldsSource
    return RldsSource(path, data_config.rlds_name,
                      split=data_config.get("split", "train"),
                      state_field=data_config.get("rlds_state_field", "state"),
                      instruction_field=data_config.get("rlds_instruction_field",
                                                        "language_instruction"), **common)
  raise ValueError(f"data.name={name!r} is not a dataset source: use 'lerobot', 'rlds' or 'sim_demos'")
