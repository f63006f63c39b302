"""cuDNN's fused attention through `jax.nn.dot_product_attention`: impl "cudnn" (the dense mask) and
the calls with no mask at all that "auto" gives it on a GPU (SigLIP's patches, GR00T's DiT
self-attention). The packed-row form with segment offsets is cudnn_packed.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejax.kernels import platform
from ejax.kernels.attention.reference import attention_mask


def dense(q, k, v, scale: float, **mask_kwargs):
  """impl "cudnn": every pair of the row under the dense mask; zeros for a query with no key."""
  if not platform.on_gpu():
    raise ValueError(f"attention impl='cudnn' needs a GPU, the backend is {platform.target_backend()!r}; "
                     "use impl='auto'")
  batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
  mask = attention_mask(q_len, kv_len, batch=batch, **mask_kwargs)
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                     implementation="cudnn")
  # cuDNN averages over all keys for a query with none allowed; the spec says zeros.
  return out * mask.any(-1)[:, :, None, None].astype(out.dtype)


def takes_unmasked(q, k, mask_kind: str, mask_kwargs: dict) -> bool:
  """Whether "auto" gives this call to cuDNN's fused attention: on a GPU, a call with no mask at all
  (SigLIP's patches, GR00T's DiT self-attention over one sample's tokens) whose head size cuDNN takes
  as it is (a multiple of 8 up to 128: SigLIP's 72, the DiT's 48), where ejax's and tokamax's kernels
  would run it zero-padded to 128 and 64, and a cuDNN that jax can use is installed. Odd lengths
  are padded to even ones first (`unmasked`)."""
  if (mask_kind != "bidirectional" or any(value is not None for name, value in mask_kwargs.items() if name != "mask_kind")
      or q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 8 or q.shape[-1] > 128
      or not platform.on_gpu()):
    return False
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
    check_cudnn_version()
  except Exception:  # no cuDNN (a CPU-only jaxlib lowering for a GPU), or one jax cannot use
    return False
  return True


def unmasked(q, k, v, scale: float):
  """cuDNN attention over every key, lengths padded to even ones: jax's cuDNN attention refuses to
  train on an odd length (its training check counts the empty bias it passes as a bias; jax 0.11.2),
  and under jax.checkpoint it says so only when the backward is traced, where no fallback can catch it
  (DreamZero's 257 image tokens, rematerialised). A padded query row is cut off again; a padded key is
  masked out, which makes the call a masked one (a [1, 1, q, k] bias: GR00T's DiT runs 49 tokens)."""
  q_len, kv_len = q.shape[1], k.shape[1]
  even = lambda x, n: jnp.pad(x, [(0, 0), (0, 1), (0, 0), (0, 0)]) if n % 2 else x
  mask = None
  if kv_len % 2:
    mask = jnp.broadcast_to(jnp.arange(kv_len + 1) < kv_len, (1, 1, q_len + q_len % 2, kv_len + 1))
  out = jax.nn.dot_product_attention(even(q, q_len), even(k, kv_len), even(v, kv_len), mask=mask, scale=scale,
                                     implementation="cudnn")
  return out[:, :q_len]
