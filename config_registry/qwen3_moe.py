"""Qwen3-MoE configs. Each public function returns a complete Trainer.Config; variants are small deltas."""
from __future__ import annotations

from config_registry import register
from config_registry.llama3 import llama3_debug
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ModelConfig
from torchtitan_lite.trainer import Trainer


@register
def qwen3_moe_debug() -> Trainer.Config:
    """Qwen3-MoE debug flavor (2.3M params, 8 experts, top-2), FP32, on the embedded corpus; llama3_debug's
    schedule, data and checkpoints."""
    cfg = llama3_debug()
    cfg.model = ModelConfig(name="qwen3_moe", flavor="debug")
    return cfg


@register
def qwen3_moe_debug_bf16() -> Trainer.Config:
    """qwen3_moe_debug with BF16 parameters / compute and FP32 gradient reduction (the router stays float32)."""
    cfg = qwen3_moe_debug()
    cfg.precision = Precision.Config(param_dtype="bfloat16", reduce_dtype="float32")
    return cfg
