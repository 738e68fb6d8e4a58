"""Qwen3-MoE configs. Each public function returns a complete Trainer.Config; variants are small deltas."""
from __future__ import annotations

import copy

from config_registry import register
from config_registry.llama3 import PRETRAINING_CORPUS, llama3_debug
from torchtitan_lite.components.lr_scheduler import LRSchedulersContainer
from torchtitan_lite.components.metrics import MetricsProcessor
from torchtitan_lite.components.optimizer import OptimizersContainer
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.moe_experts import GroupedExpertsConverter
from torchtitan_lite.components.quantization.mx import MXLinearConverter
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.config.sections import CompileConfig, ModelConfig, TrainingConfig
from torchtitan_lite.hf_assets import ASSETS_DIR
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.trainer import Trainer

QWEN3_TOKENIZER_DIR = str(ASSETS_DIR / "Qwen3-30B-A3B")
"""Qwen3's 151,643-token BPE (padded to 151,936 ids), shared by every Qwen3 size; fetch it with
scripts/download_hf_assets.py."""


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


@register
def qwen3_moe_debug_fp8() -> Trainer.Config:
    """qwen3_moe_debug_bf16 + FP8 rowwise experts (grouped GEMMs) and attention Linears (emulated on CPU; output
    projection and router gates kept in high precision)."""
    cfg = qwen3_moe_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(converters=[
        Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["output"]),
        GroupedExpertsConverter.Config(recipe_name="rowwise"),
    ])
    return cfg


@register
def qwen3_moe_debug_mxfp8() -> Trainer.Config:
    """qwen3_moe_debug_bf16 + MXFP8 experts (grouped GEMMs) and attention Linears (32-element blocks, e8m0 scales;
    emulated below Blackwell and on CPU; output projection and router gates kept in high precision)."""
    cfg = qwen3_moe_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(converters=[
        MXLinearConverter.Config(recipe_name="mxfp8"),
        GroupedExpertsConverter.Config(recipe_name="mxfp8"),
    ])
    return cfg


def _qwen3_moe_large(flavor: str, *, lr: float, steps: int = 1000) -> Trainer.Config:
    """Shared shape of the published flavors: BF16 with FP32 reduction, 4k context (Qwen3's first pretraining
    stage), cosine schedule, the Qwen3 tokenizer and a streamed hub corpus."""
    return Trainer.Config(
        model=ModelConfig(name="qwen3_moe", flavor=flavor),
        tokenizer=Tokenizer.Config(path=QWEN3_TOKENIZER_DIR),
        data=copy.deepcopy(PRETRAINING_CORPUS),
        training=TrainingConfig(steps=steps, seq_len=4096, local_batch_size=1, max_norm=1.0, seed=0),
        precision=Precision.Config(param_dtype="bfloat16", reduce_dtype="float32"),
        optimizer=OptimizersContainer.Config(lr=lr, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200, decay_type="cosine", min_lr_factor=0.1),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


@register
def qwen3_moe_30b_a3b() -> Trainer.Config:
    """Qwen3-30B-A3B (128 experts, top-8; 3.3B active), BF16, 4k sequence."""
    return _qwen3_moe_large("30B-A3B", lr=3e-4)


@register
def qwen3_moe_30b_a3b_fp8() -> Trainer.Config:
    """qwen3_moe_30b_a3b + compile + FP8 rowwise experts where they are predicted to gain (auto_filter_small_kn).
    The rule asks for 1,024 tokens per expert and torchao's rowwise size. At this width (experts 2048 x 768) the rule
    keeps every expert in BF16 and --print-fp8-plan says why: forced, they ran 0.84x of BF16 on an H200 at 1,024
    tokens per expert (qwen3_moe_30b_a3b_fp8_experts). No float8 converter: every attention Linear of this width
    (dim 2048) is below torchao's rowwise size rule too."""
    cfg = qwen3_moe_30b_a3b_fp8_experts()
    cfg.model_converters.converters[0].filter_fqns = ["auto_filter_small_kn"]
    return cfg


@register
def qwen3_moe_30b_a3b_fp8_experts() -> Trainer.Config:
    """qwen3_moe_30b_a3b + compile + FP8 rowwise on every routed expert, without the speed filter (torchao's grouped
    GEMM kernels on Hopper): for measuring them and for numerics checks at full width."""
    cfg = qwen3_moe_30b_a3b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = ModelConvertersContainer.Config(
        converters=[GroupedExpertsConverter.Config(recipe_name="rowwise")])
    return cfg


@register
def qwen3_moe_235b_a22b() -> Trainer.Config:
    """Qwen3-235B-A22B (128 experts, top-8; 22B active), BF16, 4k sequence; needs FSDP (x EP) over many GPUs."""
    cfg = _qwen3_moe_large("235B-A22B", lr=1.5e-4)
    cfg.activation_checkpoint.mode = "full"
    return cfg


@register
def qwen3_moe_235b_fp8() -> Trainer.Config:
    """qwen3_moe_235b_a22b + compile + FP8 rowwise on the Linears and experts large enough to gain (wq and wo). By
    torchao's auto_filter_small_kn, wk / wv, the output projection and the experts (4096 x 1536, below the rowwise
    size rule) stay BF16 and the router gates float32."""
    cfg = qwen3_moe_235b_a22b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = ModelConvertersContainer.Config(converters=[
        Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["output", "auto_filter_small_kn"]),
        GroupedExpertsConverter.Config(recipe_name="rowwise", filter_fqns=["auto_filter_small_kn"]),
    ])
    return cfg
