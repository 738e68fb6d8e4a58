"""qwen3_moe_debug_fp8 / _mxfp8 through the trainer: a few steps train with the experts and attention in FP8
(emulated on CPU), starting from the same loss as BF16 but not the same numbers."""
from __future__ import annotations

import math

import pytest

from config_registry import DEFAULT_REGISTRY
from tests._spike_runs import record_steps
from torchtitan_lite.components.quantization.grouped_gemm import QuantizedGroupedMM
from torchtitan_lite.config import parse_cli

# 2 blocks, one micro-batch of 2 x 32 tokens per step, no validation.
TINY = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.log_freq", "1", "--metrics.cpu_peak_tflops", "1",
        "--checkpoint.enable", "false", "--training.steps", "3"]


def _losses(config: str, folder) -> tuple[list[float], object]:
    trainer = parse_cli(["--config", config, *TINY, "--job.dump_folder", str(folder)],
                        registry=DEFAULT_REGISTRY).config.build()
    records = record_steps(trainer)
    trainer.train()
    return [r.loss for r in records], trainer.model_parts[0]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    return _losses("qwen3_moe_debug_bf16", tmp_path_factory.mktemp("bf16"))[0]


@pytest.mark.parametrize("config, recipe", [("qwen3_moe_debug_fp8", "rowwise"), ("qwen3_moe_debug_mxfp8", "mxfp8")])
def test_low_precision_experts_train(config, recipe, bf16_losses, tmp_path):
    losses, model = _losses(config, tmp_path)
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    assert len(experts) == 2
    assert all(isinstance(vars(m).get("grouped_mm"), QuantizedGroupedMM) and vars(m)["grouped_mm"].recipe == recipe
               for m in experts)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    # Same init and data: the first loss is BF16's up to FP8 rounding (about 3% relative error per GEMM
    # moves a loss of ~7.6 nats by far less than 0.05), and not BF16's exactly (the GEMMs were quantized).
    assert abs(losses[0] - bf16_losses[0]) < 0.05
    assert losses != bf16_losses
