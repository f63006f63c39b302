"""ejax's one attention op. See reference.py for the specification every implementation meets."""

from ejax.kernels.attention.reference import MASK_KINDS, attention_mask, attention_reference, block_ids_from_ar_flags


def attention(q, k, v, *, impl: str = "auto", **kwargs):
  """Attention with segment ids and a mask kind; `impl` picks the implementation.

  Until the Pallas/XLA paths land every impl runs the reference.
  """
  del impl
  return attention_reference(q, k, v, **kwargs)


__all__ = ["MASK_KINDS", "attention", "attention_mask", "attention_reference", "block_ids_from_ar_flags"]
