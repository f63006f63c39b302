"""GR00T's model.attention_impl reaches every attention call (vision, LLM, VL transformer, DiT)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ejax.kernels.attention import ops
from ejax.models import groot, layers
from tests.models.test_groot import tiny_config

_CHOOSE_IMPL = ops.choose_impl


def _traced_impls(monkeypatch, attention_impl):
  """The impl each attention call resolved to while compute_loss and sample_actions were traced."""
  seen = collections.Counter()

  def recording(q, k, impl="auto", mask_kind="bidirectional"):
    chosen = _CHOOSE_IMPL(q, k, impl, mask_kind)
    seen[chosen] += 1
    return chosen

  monkeypatch.setattr(ops, "choose_impl", recording)
  c = tiny_config()
  c.attention_impl = attention_impl
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 2, seed=3)
  noise = jax.random.normal(jax.random.key(0), batch["actions"].shape)

  def run(m, b):
    loss, _ = m.compute_loss(b, jax.random.key(1), time=jnp.array([0.3, 0.8]), noise=noise, train=False)
    return loss, m.sample_actions(b, jax.random.key(2), noise=noise, num_steps=1)

  loss, actions = nnx.jit(run)(model, batch)
  return seen, float(loss), np.asarray(actions)


def test_attention_impl_reaches_every_attention_call_and_keeps_the_values(monkeypatch):
  reference, loss_reference, actions_reference = _traced_impls(monkeypatch, "reference")
  xla, loss_xla, actions_xla = _traced_impls(monkeypatch, "xla")
  assert set(reference) == {"reference"} and set(xla) == {"xla"}
  # vision + LLM + VL transformer + DiT self- and cross-attention, for the loss and for sampling
  assert sum(xla.values()) == sum(reference.values()) >= 5
  np.testing.assert_allclose(loss_xla, loss_reference, rtol=2e-3)
  np.testing.assert_allclose(actions_xla, actions_reference, atol=2e-2)


def test_an_unknown_attention_impl_is_refused():
  c = tiny_config()
  c.attention_impl = "flash"
  model = layers.host_random_init(nnx.eval_shape(lambda: groot.create(c, nnx.Rngs(0))), seed=1, stddev=0.1)
  batch = groot.example_batch(c, 2, seed=3)
  with pytest.raises(ValueError, match="impl='flash' is not one of"):
    model.compute_loss(batch, jax.random.key(1), train=False)
