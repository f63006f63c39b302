"""The same model trained under different meshes of 8 fake CPU devices gives the same losses."""

import jax
import numpy as np
import pytest

from ejax.models.registry import MODELS
from ejax.train.loop import train
from tests.train.helpers import losses, tiny_config


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
  config = tiny_config(mesh=(1, 1, 1))
  result = train(config, str(tmp_path_factory.mktemp("single")), devices=jax.devices()[:1])
  return losses(result)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8)])
def test_mesh_matches_single_device(mesh, single_device_losses, tmp_path):
  assert jax.device_count() == 8
  result = train(tiny_config(mesh=mesh), str(tmp_path))
  np.testing.assert_allclose(losses(result), single_device_losses, rtol=2e-5, atol=2e-6)
  # The loss moves: the test would notice a mesh that silently skipped the update.
  assert single_device_losses[-1] < single_device_losses[0]


def test_parameters_are_really_sharded(tmp_path):
  result = train(tiny_config(steps=1, mesh=(2, 2, 2)), str(tmp_path))
  kernel = result["state"].params["blocks"][0]["up"]["kernel"].get_value()  # (EMBED, MLP)
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  shard_shapes = {shard.data.shape for shard in kernel.addressable_shards}
  assert shard_shapes == {(kernel.shape[0] // 2, kernel.shape[1] // 2)}


def test_grad_accumulation_matches_one_big_batch(tmp_path, monkeypatch):
  # A loss without noise, so that four micro-batches must reproduce one batch exactly.
  monkeypatch.setitem(MODELS, "deterministic", "tests.train.deterministic_model:SPEC")
  config = tiny_config(steps=3, mesh=(2, 2, 2))
  config.model.name = "deterministic"
  whole = train(config, str(tmp_path / "whole"))
  config.train.grad_accum_steps = 4
  accumulated = train(config, str(tmp_path / "accum"))
  np.testing.assert_allclose(losses(accumulated), losses(whole), rtol=1e-5, atol=1e-6)
  assert losses(whole)[-1] < losses(whole)[0]
