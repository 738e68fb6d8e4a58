"""Llama 3 family: model, flavors and Hugging Face state-dict adapter (parallelize.py is imported lazily)."""
from models.llama3.args import Llama3ModelArgs, RopeScaling
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import Transformer

__all__ = ["Llama3ModelArgs", "RopeScaling", "LLAMA3_FLAVORS", "Transformer"]
