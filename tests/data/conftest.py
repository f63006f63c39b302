"""Session fixtures: small LeRobot v3.0 and v2.1 datasets of the same episodes, built on the fly."""

import pytest

from ejax.data.lerobot_writer import LeRobotV21Writer, LeRobotV3Writer
from tests.data.builders import make_episodes, write_dataset


@pytest.fixture(scope="session")
def episodes():
  return make_episodes()


@pytest.fixture(scope="session")
def v3_root(tmp_path_factory, episodes):
  return write_dataset(tmp_path_factory.mktemp("v3") / "dataset", LeRobotV3Writer, episodes)


@pytest.fixture(scope="session")
def v21_root(tmp_path_factory, episodes):
  return write_dataset(tmp_path_factory.mktemp("v21") / "dataset", LeRobotV21Writer, episodes)
