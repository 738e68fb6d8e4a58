"""Training data: the embedded corpus, sources opened through Hugging Face ``datasets``, token stores, the
global window order and the resumable data loaders."""
from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.dataloader import TextDataLoader
from torchtitan_lite.components.data.errors import DataSourceError

__all__ = ["Batch", "DataSourceError", "TextDataLoader"]
