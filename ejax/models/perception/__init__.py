"""Optional simulator-trained perception aids any VLA hooks (model.perception; config.py says what
each setting does, module.py what the module computes)."""

from ejax.models.perception.config import (PerceptionConfig, StateLayout, default_config, read,  # noqa: F401
                                           state_slots)
from ejax.models.perception.module import Perception, Seen  # noqa: F401
from ejax.models.perception import upgrade  # noqa: F401
from ejax.models.perception.inference import acts_on_a_given_estimate, slot_statistics, with_statistics  # noqa: F401
from ejax.models.perception.upgrade import upgrade_config, upgrade_params  # noqa: F401
