"""Training data: the embedded corpus, sources opened through Hugging Face ``datasets``, packing into
fixed windows, and the resumable per-rank data loader."""
from torchtitan_lite.components.data.dataloader import TextDataLoader
from torchtitan_lite.components.data.errors import DataSourceError

__all__ = ["DataSourceError", "TextDataLoader"]
