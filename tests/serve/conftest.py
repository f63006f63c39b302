"""One small GR00T checkpoint of the train job for every serve test (about 30 s to make)."""

import pytest

from tests.train.helpers import groot_sim_checkpoint

try:
  import openpi_client  # noqa: F401
except ImportError as error:
  raise ImportError("tests/serve drive the server with openpi's own client: "
                    "pip install --no-deps -c constraints.txt openpi-client (see the README's test command)") from error

TASK = "goal_open_drawer"
IMAGE_SIZE = 32  # runlocal GR00T's vision size: served images need no resize


@pytest.fixture(scope="session")
def groot_checkpoint(tmp_path_factory):
  return groot_sim_checkpoint(tmp_path_factory.mktemp("serve"), task=TASK, image_size=IMAGE_SIZE)
