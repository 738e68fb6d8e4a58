"""Distributed checkpoints (DCP), exact resume and Hugging Face export/import."""
from torchtitan_lite.components.checkpoint.manager import CheckpointManager
from torchtitan_lite.components.checkpoint.stateful import ModelWrapper
from torchtitan_lite.components.checkpoint.verify import CheckpointError

__all__ = ["CheckpointError", "CheckpointManager", "ModelWrapper"]
