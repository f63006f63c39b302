"""ejax's one attention op. See reference.py for the specification every implementation meets."""

from ejax.kernels.attention.ops import IMPLS, attention, choose_impl, default_impl, flash_attention, with_attention_impl
from ejax.kernels.attention.reference import MASK_KINDS, attention_mask, attention_reference, block_ids_from_ar_flags
from ejax.kernels.attention.routes import unchecked_layout
from ejax.kernels.attention.tiles import BlockSizes

__all__ = ["IMPLS", "MASK_KINDS", "BlockSizes", "attention", "attention_mask", "attention_reference",
           "block_ids_from_ar_flags", "choose_impl", "default_impl", "flash_attention", "unchecked_layout",
           "with_attention_impl"]
