"""Named rematerialisation policies: config.train.remat picks how much activation memory to trade
for recomputation in each block."""

from __future__ import annotations

import jax

POLICIES = {
    "none": None,  # keep every activation: fastest, most memory
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute elementwise
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls
}


def remat_policy(name: str):
  """The jax.checkpoint policy for a config name; `None` for "none" (no remat)."""
  if name not in POLICIES:
    raise ValueError(f"unknown remat policy {name!r}: use one of {', '.join(POLICIES)}")
  return POLICIES[name]
