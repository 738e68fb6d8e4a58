"""DeepSeek-V3 family: model, flavors and Hugging Face state-dict adapter (parallelize.py is imported lazily)."""
from models.deepseek_v3.args import DeepSeekV3ModelArgs
from models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS
from models.deepseek_v3.model import DeepSeekV3Model

__all__ = ["DeepSeekV3ModelArgs", "DEEPSEEK_V3_FLAVORS", "DeepSeekV3Model"]
