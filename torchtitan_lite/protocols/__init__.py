"""Interfaces that components plug into."""
from torchtitan_lite.protocols.model_converter import ModelConverter, ModelConvertersContainer

__all__ = ["ModelConverter", "ModelConvertersContainer"]
