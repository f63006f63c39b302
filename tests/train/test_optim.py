"""ejax/train/optim.py: the grouped global norm and clipping agree with optax's; train.compute_copy
trains the same numbers as casting the fp32 weights in the step, and its bf16 copy is always the
cast of the weights the optimizer wrote."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ejax.train import optim
from tests.train.helpers import groot_steps, leaves


def _tree(seed: int = 0):
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  draw = lambda shape, dtype=jnp.float32: jax.random.normal(next(keys), shape, dtype)
  # Leaves of one shape (stacked into one reduction), one of a shape of its own, a bf16 one, a scalar.
  return {"blocks": [{"w": draw((8, 4)), "b": draw((4,))} for _ in range(3)], "head": draw((4, 2)),
          "half": draw((4, 2), jnp.bfloat16), "scale": draw(())}


def test_global_norm_is_the_norm_of_all_leaves():
  tree = _tree()
  exact = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
  np.testing.assert_allclose(optim.global_norm(tree), exact, rtol=1e-6)
  np.testing.assert_allclose(jax.jit(optim.global_norm)(tree), exact, rtol=1e-6)
  # optax's on fp32 leaves (it squares a bf16 leaf in bf16; this squares every leaf in fp32).
  fp32 = {key: value for key, value in tree.items() if key != "half"}
  np.testing.assert_allclose(optim.global_norm(fp32), optax.tree.norm(fp32), rtol=1e-6)
  assert optim.global_norm({}) == 0.0


@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # clipped / left as it is
def test_clipping_is_optaxs(max_norm):
  tree = {key: value for key, value in _tree(1).items() if key != "half"}
  assert (optax.tree.norm(tree) > max_norm) == (max_norm == 1.0)
  ours, _ = optim.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
  theirs, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)
  np.testing.assert_allclose(optax.tree.norm(ours), min(max_norm, optax.tree.norm(tree)), rtol=1e-5)


def test_the_copy_is_kept_only_where_it_differs_from_the_master_weights():
  chain = lambda **train: optim.make_optimizer(_train(**train))[0].init({"w": jnp.ones((2, 2))})
  assert optim.compute_copy(chain(compute_copy=True, compute_dtype="bfloat16"))["w"].dtype == jnp.bfloat16
  assert optim.compute_copy(chain(compute_copy=False, compute_dtype="bfloat16")) is None
  assert optim.compute_copy(chain(compute_copy=True, compute_dtype="float32")) is None  # nothing to cast


def _train(**updates):
  from tests.train.helpers import load_config
  train = load_config("configs/tiny.py", "runlocal").train
  train.update(updates)
  return train


@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_compute_copy_trains_the_same_numbers(accumulate):
  """bf16 compute with and without the copy: the same loss, gradient norm and weights after 3 steps
  (the copy is the cast the step made), on the trained rows of the embodiment tables only, with
  micro-batches; the copy always equals the cast of the weights the optimizer wrote."""
  settings = dict(compute_dtype="bfloat16", embodiment_rows="1", weight_decay=0.1, grad_accum_steps=accumulate)
  _, cast, cast_metrics = groot_steps(3, compute_copy=False, **settings)
  _, kept, kept_metrics = groot_steps(3, compute_copy=True, **settings)
  assert optim.compute_copy(cast.opt_state) is None
  for name in ("loss", "grad_norm"):
    np.testing.assert_allclose(kept_metrics[name], cast_metrics[name], rtol=1e-6, err_msg=name)
  cast_weights, kept_weights = leaves(cast.params), leaves(kept.params)
  assert cast_weights.keys() == kept_weights.keys() and len(kept_weights) > 20
  for path, value in kept_weights.items():
    np.testing.assert_allclose(value, cast_weights[path], rtol=1e-6, atol=1e-7, err_msg=path)
  copy = leaves(optim.compute_copy(kept.opt_state))
  assert copy.keys() == kept_weights.keys()
  for path, value in copy.items():
    weights = kept_weights[path][1:2] if value.shape != kept_weights[path].shape else kept_weights[path]
    assert value.dtype == jnp.bfloat16, path
    np.testing.assert_array_equal(value, weights.astype(jnp.bfloat16), err_msg=path)
