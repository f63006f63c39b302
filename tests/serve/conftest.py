"""Every serve test serves the session's small GR00T checkpoint (tests/conftest.py: groot_sft_checkpoint)."""

import pytest

from tests.train.helpers import SFT_IMAGE_SIZE, SFT_TASK

try:
  import openpi_client  # noqa: F401
except ImportError as error:
  raise ImportError("tests/serve drive the server with openpi's own client: "
                    "pip install --no-deps -c constraints.txt openpi-client (see the README's test command)") from error

TASK, IMAGE_SIZE = SFT_TASK, SFT_IMAGE_SIZE  # runlocal GR00T's vision size: served images need no resize


@pytest.fixture(scope="session")
def groot_checkpoint(groot_sft_checkpoint):
  return groot_sft_checkpoint
