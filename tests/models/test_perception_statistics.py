"""The stats job's statistics land on the state slots model.perception declares (StateLayout), as the
policy hands them to the estimate's geometry (perception.slot_statistics); ones that do not fit are
one clear error."""

import numpy as np
import pytest
from ml_collections import ConfigDict

from ejax.data.stats import compute_stats
from ejax.models import perception

STATE, ESTIMATE = "observation.state", "observation.environment_state"


class Columns:
  """What compute_stats (the stats job's pass) reads of a source: its columns and keys."""

  state_key, action_key = STATE, "action"

  def __init__(self, state_dim: int, estimate_dim: int, steps: int = 64):
    rng = np.random.default_rng(0)
    self.aux_keys = [ESTIMATE]
    self._columns = {STATE: rng.normal(2.0, 3.0, (steps, state_dim)).astype(np.float32),
                     "action": rng.normal(0.0, 1.0, (steps, 4)).astype(np.float32),
                     ESTIMATE: rng.normal(0.5, 0.25, (steps, estimate_dim)).astype(np.float32)}

  def columns(self):
    return self._columns


def quickstart_model(num_cameras: int = 2, state_dim: int = 11) -> dict:
  """configs/groot.py's quickstart sizing: the data's 11-d state, then the module's slots."""
  settings = perception.default_config()
  settings.geometry.cameras = {"agentview": {}, "wrist": {}}
  return dict(name="groot", num_cameras=num_cameras, perception=settings.to_dict(),
              max_state_dim=state_dim + perception.state_slots(settings, num_cameras))


def test_the_stats_jobs_statistics_line_up_with_the_declared_state_slots():
  model = quickstart_model()
  data = dict(state_key=STATE, aux_state_key=ESTIMATE, normalization="mean_std")
  stats = compute_stats(Columns(state_dim=11, estimate_dim=7))
  layout = perception.read(model).layout
  assert (model["max_state_dim"], layout.data_dims, layout.estimate, layout.keypoints) == (26, 11, slice(11, 18),
                                                                                           slice(18, 26))
  norm = perception.slot_statistics(perception.read(model), ConfigDict(data), stats)
  assert len(norm["state"][0]) == layout.data_dims
  assert len(norm["estimate"][0]) == layout.estimate.stop - layout.estimate.start
  np.testing.assert_allclose(norm["state"][0], stats[STATE]["mean"], rtol=1e-6)
  np.testing.assert_allclose(norm["estimate"][1], stats[ESTIMATE]["std"], rtol=1e-5)
  # the policy's path (load_policy -> with_statistics) hands the geometry the same
  config = perception.with_statistics(ConfigDict(dict(model=model, data=data)), stats)
  assert config.model.perception.geometry.norm.to_dict() == norm

  # a smaller state than the data's slots (9 of 11): identity past its dims, as the collate pads
  small = perception.slot_statistics(perception.read(model), ConfigDict(data), compute_stats(Columns(9, 7)))
  assert small["state"][0][9:] == [0.0, 0.0] and small["state"][1][9:] == [1.0, 1.0]
  # without statistics (data.normalization none) the values are metres already: identity on the same slots
  plain = perception.slot_statistics(perception.read(model), ConfigDict(dict(data, normalization="none")), None)
  assert plain["state"] == [[0.0] * 11, [1.0] * 11] and plain["estimate"] == [[0.0] * 7, [1.0] * 7]


@pytest.mark.parametrize("state_dim, estimate_dim, named", [(12, 7, "data_dims=11"), (11, 6, "estimate.dim=7")])
def test_statistics_that_do_not_fit_the_declared_slots_are_one_clear_error(state_dim, estimate_dim, named):
  model = quickstart_model()
  data = ConfigDict(dict(state_key=STATE, aux_state_key=ESTIMATE, normalization="mean_std"))
  stats = compute_stats(Columns(state_dim, estimate_dim))
  with pytest.raises(ValueError, match=named) as error:
    perception.with_statistics(ConfigDict(dict(model=model, data=data)), stats)
  assert "\n" not in str(error.value) and "stats job" in str(error.value)
