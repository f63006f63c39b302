"""ejax's own blockwise kernels behind one custom_vjp: the Pallas/Triton kernel (pallas_gpu.py) or the
XLA loops (xla.py), forward and backward, on operands already padded to whole tiles (tiles.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax

from ejax.kernels.attention import pallas_gpu, xla
from ejax.kernels.attention.tiles import BlockSizes, MaskInputs


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static choices of one blockwise call (hashable: it is a nondiff argument of the custom_vjp)."""
  backend: str  # "xla" | "pallas" ("mosaic" for the Mosaic GPU routes, which use only `scale`)
  ordered: bool
  scale: float
  blocks: BlockSizes
  interpret: bool


def _launch(plan: Plan) -> dict:
  return dict(num_warps=plan.blocks.num_warps, num_stages=plan.blocks.num_stages)


def forward(plan: Plan, q, k, v, mask: MaskInputs):
  """(out, lse) of the plan's backend."""
  kwargs = dict(ordered=plan.ordered, scale=plan.scale, block_q=plan.blocks.block_q,
                block_kv=plan.blocks.block_kv)
  if plan.backend == "pallas":
    return pallas_gpu.forward(q, k, v, mask, interpret=plan.interpret, **kwargs, **_launch(plan))
  return xla.forward(q, k, v, mask, **kwargs)


def backward(plan: Plan, q, k, v, mask: MaskInputs, out, lse, d_out):
  """(dq, dk, dv) of the plan's backend from the forward's out and lse."""
  kwargs = dict(ordered=plan.ordered, scale=plan.scale, block_q=plan.blocks.block_q_bwd,
                block_kv=plan.blocks.block_kv_bwd)
  if plan.backend == "pallas":
    return pallas_gpu.backward(q, k, v, mask, out, lse, d_out, interpret=plan.interpret, **kwargs,
                               **_launch(plan))
  return xla.backward(q, k, v, mask, out, lse, d_out, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, q, k, v, q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups):
  """The attention output of tile-padded operands; the mask as MaskInputs' six arrays."""
  mask = MaskInputs(q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups)
  return forward(plan, q, k, v, mask)[0]


def _attention_fwd(plan: Plan, q, k, v, q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups):
  mask = MaskInputs(q_segment_ids, kv_segment_ids, q_keys, kv_keys, q_groups, kv_groups)
  out, lse = forward(plan, q, k, v, mask)
  return out, (q, k, v, mask, out, lse)


def _attention_bwd(plan: Plan, residuals, d_out):
  q, k, v, mask, out, lse = residuals
  dq, dk, dv = backward(plan, q, k, v, mask, out, lse, d_out)
  return dq, dk, dv, None, None, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
