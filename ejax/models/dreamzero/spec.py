"""DreamZero's registry entry (ejax.models.registry): the model, its example batch and the collate of
its inputs module, kept apart so that model.py and inputs.py import one way only (inputs -> model)."""

from __future__ import annotations

from ejax.models.dreamzero import encode, inputs
from ejax.models.dreamzero.model import COMPONENTS, create, example_batch, trainable_filter  # noqa: F401 (the summary job reads COMPONENTS here)
from ejax.models.registry import ModelSpec

SPEC = ModelSpec(create=create, example_batch=example_batch, trainable_filter=trainable_filter,
                 make_collate=inputs.make_collate, encoder_cache=encode)
