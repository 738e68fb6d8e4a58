"""Llama 3 configs. Each public function returns a complete Trainer.Config; variants are small deltas."""
from __future__ import annotations

import copy

from config_registry import register
from torchtitan_lite.components.checkpoint import CheckpointManager
from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.lr_scheduler import LRSchedulersContainer
from torchtitan_lite.components.metrics import MetricsProcessor
from torchtitan_lite.components.optimizer import OptimizersContainer
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter, Float8Recipe
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.mx import MXLinearConverter
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.components.validate import Validator
from torchtitan_lite.config.sections import CompileConfig, ModelConfig, TrainingConfig
from torchtitan_lite.hf_assets import LLAMA3_TOKENIZER_DIR
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.trainer import Trainer


@register
def llama3_debug() -> Trainer.Config:
    """Llama 3 debug flavor (~6M params), FP32, on the embedded corpus; trains on a 2-core CPU in ~2.5 min."""
    return Trainer.Config(
        model=ModelConfig(flavor="debug"),
        # 16 x 128 tokens per step: batches of 8 made the per-step loss swing by +-0.8 nats between
        # source files, and at 3e-3 with a short warmup the loss leaves the unigram plateau (~5.0)
        # within the 200 steps (measured: last-10 mean 54% of the first loss, vs 61% at 8 x 2e-3).
        training=TrainingConfig(steps=200, seq_len=128, local_batch_size=16, max_norm=1.0, seed=0),
        precision=Precision.Config(param_dtype="float32", reduce_dtype="float32"),
        optimizer=OptimizersContainer.Config(lr=3e-3, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine", min_lr_factor=0.1),
        validation=Validator.Config(enable=True, freq=100, steps=10),
        metrics=MetricsProcessor.Config(log_freq=10),
        # The run leaves steps 100 and 200 to sample from, convert or resume: ~70 MB each.
        checkpoint=CheckpointManager.Config(enable=True, interval=100),
    )


@register
def llama3_debug_bf16() -> Trainer.Config:
    """llama3_debug with BF16 parameters / compute and FP32 gradient reduction: the FP8 baseline."""
    cfg = llama3_debug()
    cfg.precision = Precision.Config(param_dtype="bfloat16", reduce_dtype="float32")
    return cfg


@register
def llama3_debug_fp16() -> Trainer.Config:
    """llama3_debug in FP16 with dynamic loss scaling."""
    cfg = llama3_debug()
    cfg.precision = Precision.Config(param_dtype="float16", reduce_dtype="float32", loss_scaling="dynamic")
    return cfg


@register
def llama3_debug_fp8() -> Trainer.Config:
    """llama3_debug_bf16 + FP8 tensorwise Linears (output layer kept in BF16)."""
    cfg = llama3_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(
        converters=[Float8LinearConverter.Config(recipe_name="tensorwise", filter_fqns=["output"])]
    )
    return cfg


def _fp8_head(cfg: Trainer.Config) -> Trainer.Config:
    """``cfg`` with its float8 converter's output head converted too: keep_output_hp off and 'output' out of
    filter_fqns (either one alone keeps the head in high precision)."""
    (converter,) = cfg.model_converters.converters
    assert isinstance(converter, Float8LinearConverter.Config), converter
    converter.keep_output_hp = False
    converter.filter_fqns = [entry for entry in converter.filter_fqns if entry != "output"]
    return cfg


@register
def llama3_debug_fp8_head() -> Trainer.Config:
    """llama3_debug_fp8 with the output head in FP8 tensorwise too, for its accuracy verdict (recipe
    tensorwise_head). The head's logits feed the softmax over the vocabulary, where FP8 error reaches the loss
    unabsorbed: it trades accuracy there for speed, so the head stays BF16 by default."""
    return _fp8_head(llama3_debug_fp8())


@register
def llama3_debug_fp8_rowwise() -> Trainer.Config:
    """llama3_debug_bf16 + FP8 rowwise Linears (output layer kept in BF16)."""
    cfg = llama3_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(
        converters=[Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["output"])]
    )
    return cfg


@register
def llama3_debug_mxfp8() -> Trainer.Config:
    """llama3_debug_bf16 + MXFP8 Linears (32-element blocks, e8m0 scales; emulated below Blackwell and on CPU;
    output layer kept in BF16)."""
    cfg = llama3_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(converters=[MXLinearConverter.Config(recipe_name="mxfp8")])
    return cfg


@register
def llama3_debug_fp8_blockwise() -> Trainer.Config:
    """llama3_debug_bf16 + DeepSeek-V3 blockwise FP8 Linears (1x128 tiles, 128x128 weight blocks, power-of-2
    scales; emulated on CPU; output layer kept in BF16). Every block Linear of the debug flavor (dims 128, 256,
    768) is a multiple of 128. With --parallelism.dp_shard 2, FSDP gathers FP8 blocks for wq, wo, w1, w2 and w3;
    wk / wv (128 rows, 64 per shard) are gathered in BF16 (the plan says why)."""
    cfg = llama3_debug_bf16()
    cfg.model_converters = ModelConvertersContainer.Config(
        converters=[Float8BlockwiseConverter.Config(power_of_2_scales=True)])
    return cfg


PRETRAINING_CORPUS = TextDataLoader.Config(
    dataset="HuggingFaceFW/fineweb-edu", dataset_config="sample-10BT", text_field="text",
    streaming=True, shuffle="none")
"""FineWeb-Edu's 10B-token sample, streamed from the hub (no full download; read in shard order)."""


def _llama3_large(flavor: str, *, lr: float, steps: int = 1000) -> Trainer.Config:
    """Shared shape of the published flavors: BF16 with FP32 reduction, 8k context, cosine schedule, the
    Llama 3 tokenizer (fetched with scripts/download_hf_assets.py) and a streamed hub corpus."""
    return Trainer.Config(
        model=ModelConfig(flavor=flavor),
        tokenizer=Tokenizer.Config(path=LLAMA3_TOKENIZER_DIR),
        data=copy.deepcopy(PRETRAINING_CORPUS),
        training=TrainingConfig(steps=steps, seq_len=8192, local_batch_size=1, max_norm=1.0, seed=0),
        precision=Precision.Config(param_dtype="bfloat16", reduce_dtype="float32"),
        optimizer=OptimizersContainer.Config(lr=lr, weight_decay=0.1),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200, decay_type="cosine", min_lr_factor=0.1),
        metrics=MetricsProcessor.Config(log_freq=10),
    )


@register
def llama3_1b() -> Trainer.Config:
    """Llama 3.2 1B (tied embeddings), BF16."""
    return _llama3_large("1B", lr=3e-4)


@register
def llama3_3b() -> Trainer.Config:
    """Llama 3.2 3B (tied embeddings), BF16."""
    return _llama3_large("3B", lr=3e-4)


@register
def llama3_8b() -> Trainer.Config:
    """Llama 3.1 8B, BF16, 8k sequence."""
    return _llama3_large("8B", lr=3e-4)


@register
def llama3_70b() -> Trainer.Config:
    """Llama 3.1 70B, BF16, 8k sequence; needs FSDP (and TP) over many GPUs."""
    cfg = _llama3_large("70B", lr=1.5e-4)
    cfg.activation_checkpoint.mode = "full"
    return cfg


@register
def llama3_405b() -> Trainer.Config:
    """Llama 3.1 405B, BF16, 8k sequence; needs FSDP x TP over many nodes."""
    cfg = _llama3_large("405B", lr=8e-5)
    cfg.activation_checkpoint.mode = "full"
    return cfg


def _fp8(recipe: Float8Recipe, *, all_gather: bool) -> ModelConvertersContainer.Config:
    """FP8 on every large Linear: the output projection and layers too small to gain are skipped."""
    return ModelConvertersContainer.Config(
        converters=[
            Float8LinearConverter.Config(
                recipe_name=recipe,
                enable_fsdp_float8_all_gather=all_gather,
                precompute_float8_dynamic_scale_for_fsdp=all_gather,
                filter_fqns=["output", "auto_filter_small_kn"],
            )
        ]
    )


@register
def llama3_8b_fp8() -> Trainer.Config:
    """llama3_8b + compile + FP8 tensorwise with FP8 FSDP all-gather and precomputed scales."""
    cfg = llama3_8b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = _fp8("tensorwise", all_gather=True)
    return cfg


@register
def llama3_8b_fp8_head() -> Trainer.Config:
    """llama3_8b_fp8 with the output head (4096 x 128256) in FP8 tensorwise too: 1.58x faster than BF16 in the
    H200 layer bench, ~3% of a 17-block proxy step saved. The head's logits feed the softmax over the vocabulary,
    so it trades accuracy there for speed; off by default (llama3_8b_fp8 keeps the head BF16)."""
    return _fp8_head(llama3_8b_fp8())


@register
def llama3_8b_fp8_rowwise() -> Trainer.Config:
    """llama3_8b + compile + FP8 rowwise (BF16 all-gather: the input-gradient GEMM needs the weight scaled along its
    other axis, so one gathered per-row-scaled copy cannot serve both GEMMs)."""
    cfg = llama3_8b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = _fp8("rowwise", all_gather=False)
    return cfg


@register
def llama3_8b_mxfp8() -> Trainer.Config:
    """llama3_8b + compile + MXFP8 on every Linear but the output projection (real MX kernels on Blackwell)."""
    cfg = llama3_8b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = ModelConvertersContainer.Config(converters=[MXLinearConverter.Config(recipe_name="mxfp8")])
    return cfg


@register
def llama3_8b_fp8_blockwise() -> Trainer.Config:
    """llama3_8b + compile + blockwise FP8 on every Linear but the output projection (torchao's kernels on an
    sm_90 GPU, float32 scales as they compute them; BF16 all-gather)."""
    cfg = llama3_8b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = ModelConvertersContainer.Config(converters=[Float8BlockwiseConverter.Config()])
    return cfg


@register
def llama3_70b_fp8() -> Trainer.Config:
    """llama3_70b + compile + FP8 tensorwise with FP8 FSDP all-gather and precomputed scales."""
    cfg = llama3_70b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = _fp8("tensorwise", all_gather=True)
    return cfg


@register
def llama3_405b_fp8() -> Trainer.Config:
    """llama3_405b + compile + FP8 tensorwise with FP8 FSDP all-gather and precomputed scales."""
    cfg = llama3_405b()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = _fp8("tensorwise", all_gather=True)
    return cfg


@register
def llama3_8b_128k() -> Trainer.Config:
    """llama3_8b at a 131072-token context: one sequence per rank, attention within each document, context
    parallelism 8 (each rank holds 16384 tokens of the sequence, K/V all-gathered from its CP group) and full
    activation checkpointing. It continues an 8K run (llama3_8b): pass that run's checkpoint as
    --checkpoint.initial_load_path. The 8B flavor's RoPE is already Llama 3.1-scaled to 128K (max_seq_len
    131072), so the model is the 8K run's."""
    cfg = llama3_8b()
    cfg.training.seq_len = 131072
    cfg.training.local_batch_size = 1
    cfg.model.attention_mask = "document"
    cfg.parallelism.cp = 8
    cfg.activation_checkpoint.mode = "full"
    return cfg


@register
def llama3_8b_128k_fp8() -> Trainer.Config:
    """llama3_8b_128k + compile + FP8 tensorwise with FP8 FSDP all-gather and precomputed scales."""
    cfg = llama3_8b_128k()
    cfg.compile = CompileConfig(enable=True)
    cfg.model_converters = _fp8("tensorwise", all_gather=True)
    return cfg
