"""The FP8 share of an MoE model's training FLOPs counts its FP8 routed experts (the moe_experts converter's
grouped GEMMs) beside its FP8 Linears, in --print-fp8-plan's table and in the launch log's summary."""
from __future__ import annotations

import re

import torch

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.components.quantization import expert_quantizer, fp8_plan_summary, linear_quantizer, low_precision_plan
from torchtitan_lite.config import parse_cli
from torchtitan_lite.resolved_run import resolve_run

SEQ_LEN = 128


def _run_and_model():
    cfg = parse_cli(["--config", "qwen3_moe_debug_fp8"], registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=1, device_type="cpu")
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    return run, model


def _expected_share(run, model) -> tuple[float, float]:
    """(whole share, experts' part) in percent, counted here from the plans: 6 * in * out per token for each FP8
    Linear, and for each FP8 expert weight times the top_k experts a token visits."""
    converters = run.converters.converters
    linears = sum(6 * r.in_features * r.out_features for r in linear_quantizer(converters).plan_rows(model)
                  if r.recipe is not None)
    top_k = model.moe_facts().top_k
    experts = sum(6 * r.in_features * r.out_features * top_k for r in expert_quantizer(converters).plan_rows(model)
                  if r.experts and r.recipe is not None)
    total = model.flops_per_token(SEQ_LEN)
    assert experts > 0  # every routed expert of this config runs in FP8 rowwise
    return 100 * (linears + experts) / total, 100 * experts / total


def _share(text: str) -> float:
    return float(re.search(r"FP8 share: ([\d.]+)%", text)[1])


def test_the_plan_table_counts_fp8_experts_in_the_share():
    run, model = _run_and_model()
    whole, experts = _expected_share(run, model)
    text = low_precision_plan(run.converters.converters, model, seq_len=SEQ_LEN,
                              total_flops_per_token=model.flops_per_token(SEQ_LEN))
    assert _share(text) == round(whole, 1)
    assert f"FP8 routed experts {experts:.1f}%" in text


def test_the_launch_log_summary_counts_fp8_experts_in_the_share():
    run, model = _run_and_model()
    whole, _ = _expected_share(run, model)
    run.converters.convert(model)
    assert _share(fp8_plan_summary(run.converters.converters, model)) == round(whole, 1)
