"""DeepSeek-V3 configs. Each public function returns a complete Trainer.Config; variants are small deltas."""
from __future__ import annotations

from config_registry import register
from config_registry.llama3 import _llama3_large, llama3_debug
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.moe_experts import GroupedExpertsConverter
from torchtitan_lite.config.sections import ActivationCheckpointConfig, CompileConfig, ModelConfig
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.trainer import Trainer

ROUTER_GATES = "router.gate"
"""filter_fqns entry of the MoE router gates: DeepSeek-V3 keeps its gating in high precision (the router computes
its logits in float32 whatever the recipe, models/common/moe/router.py); --print-fp8-plan lists the reasons."""


def _deepseek_v3_recipe(*, power_of_2_scales: bool) -> ModelConvertersContainer.Config:
    """DeepSeek-V3's FP8 recipe: blockwise E4M3 for every Linear but the router gates and the output head
    (keep_output_hp), and for the routed experts' grouped GEMMs (the moe_experts converter, recipe blockwise);
    the embedding, norms and attention core are not Linears and stay high precision. ``power_of_2_scales`` is
    the Linears' choice. The experts always take power-of-2 scales (DeepSeek-V3's choice): no grouped blockwise
    kernel exists, and power-of-2 scales make the emulated tiles exact in bfloat16, so their grouped GEMMs stay
    bfloat16 GEMMs that compile with the block; float32 scales would need float32 GEMMs run outside the
    compiled graph (on a GPU, one per expert)."""
    return ModelConvertersContainer.Config(converters=[
        Float8BlockwiseConverter.Config(power_of_2_scales=power_of_2_scales, filter_fqns=[ROUTER_GATES]),
        GroupedExpertsConverter.Config(recipe_name="blockwise", power_of_2_scales=True)])


@register
def deepseek_v3_debug() -> Trainer.Config:
    """DeepSeek-V3 debug flavor (4.8M params, 3.0M active; MLA, 1 dense + 3 MoE blocks of 8 experts), FP32, on the
    embedded corpus; llama3_debug's schedule, data and checkpoints."""
    cfg = llama3_debug()
    cfg.model = ModelConfig(name="deepseek_v3", flavor="debug")
    return cfg


@register
def deepseek_v3_debug_bf16() -> Trainer.Config:
    """deepseek_v3_debug with BF16 parameters / compute and FP32 gradient reduction (the router stays float32)."""
    cfg = deepseek_v3_debug()
    cfg.precision = Precision.Config(param_dtype="bfloat16", reduce_dtype="float32")
    return cfg


@register
def deepseek_v3_debug_fp8_blockwise() -> Trainer.Config:
    """deepseek_v3_debug_bf16 + DeepSeek-V3's precision recipe: blockwise FP8 Linears and routed experts (1x128
    tiles, 128x128 weight blocks, power-of-2 scales; emulated on CPU), router gates and output head in high
    precision."""
    cfg = deepseek_v3_debug_bf16()
    cfg.model_converters = _deepseek_v3_recipe(power_of_2_scales=True)
    return cfg


@register
def deepseek_v3_16b() -> Trainer.Config:
    """DeepSeek-V3 architecture at Moonlight-16B-A3B's shapes (16B params, 2.9B active), BF16, 4k sequence; the
    Llama 3 tokenizer stands in for Moonlight's (its 163,840-row vocabulary is kept)."""
    cfg = _llama3_large("16B", lr=4.2e-4)
    cfg.model = ModelConfig(name="deepseek_v3", flavor="16B")
    cfg.training.seq_len = 4096
    return cfg


@register
def deepseek_v3_671b_fp8() -> Trainer.Config:
    """DeepSeek-V3 671B (37.6B active) + compile + its FP8 recipe (blockwise Linears and routed experts), BF16,
    4k sequence, full activation checkpointing; needs expert parallelism (--parallelism.ep 8 on 256 GPUs).

    The recipe: blockwise Linears (torchao's kernels on sm_90, float32 scales as they compute them) and blockwise
    routed experts (power-of-2 scales, emulated: no grouped blockwise FP8 GEMM exists in torch / torchao, so they
    cost BF16 grouped GEMMs plus the tiles' casts), router gates and output head high precision; peak lr 2.2e-4
    as published. Needs expert parallelism to fit 80 GB GPUs: on 256 GPUs run it with --parallelism.ep 8 (README,
    DeepSeek-V3)."""
    cfg = _llama3_large("671B", lr=2.2e-4)
    cfg.model = ModelConfig(name="deepseek_v3", flavor="671B")
    cfg.training.seq_len = 4096
    cfg.compile = CompileConfig(enable=True)
    cfg.activation_checkpoint = ActivationCheckpointConfig(mode="full")
    cfg.model_converters = _deepseek_v3_recipe(power_of_2_scales=False)
    return cfg
