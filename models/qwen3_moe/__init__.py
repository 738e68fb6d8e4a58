"""Qwen3-MoE family: model, flavors and Hugging Face state-dict adapter (parallelize.py is imported lazily)."""
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.flavors import QWEN3_MOE_FLAVORS
from models.qwen3_moe.model import Qwen3MoeModel

__all__ = ["Qwen3MoeModelArgs", "QWEN3_MOE_FLAVORS", "Qwen3MoeModel"]
