"""orbax checkpoints: async saves, exact resume, restore onto another mesh."""

from ejax.checkpoint.manager import Checkpointer, CheckpointError, abstract_target, gather_json

__all__ = ["Checkpointer", "CheckpointError", "abstract_target", "gather_json"]
