"""The Qwen3-MoE registry configs with low-precision experts: registered, complete, and converting what they say."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import config_registry
from config_registry import DEFAULT_REGISTRY
from models import build_model_args, get_model_spec
from torchtitan_lite.components.quantization import expert_quantizer, linear_quantizer
from torchtitan_lite.config import config_to_toml, parse_cli
from torchtitan_lite.resolved_run import resolve_run

MOE = ["qwen3_moe_debug", "qwen3_moe_debug_bf16", "qwen3_moe_debug_fp8", "qwen3_moe_debug_mxfp8",
       "qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8", "qwen3_moe_30b_a3b_fp8_experts", "qwen3_moe_235b_a22b",
       "qwen3_moe_235b_fp8"]
# config -> (dense Linear converter and recipe, expert recipe)
LOW_PRECISION = {
    "qwen3_moe_debug_fp8": (("float8", "rowwise"), "rowwise"),
    "qwen3_moe_debug_mxfp8": (("mx", "mxfp8"), "mxfp8"),
    "qwen3_moe_30b_a3b_fp8_experts": (None, "rowwise"),
}
SPEED_FILTERED = {"qwen3_moe_30b_a3b_fp8": None, "qwen3_moe_235b_fp8": ("float8", "rowwise")}
"""Configs whose experts run FP8 rowwise only where predicted to gain: at these widths none is (dense converter)."""


def test_moe_configs_are_registered():
    assert set(MOE) <= set(config_registry.names())


@pytest.mark.parametrize("name", MOE)
def test_moe_config_round_trips_through_toml_and_builds_on_meta(name, tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text(config_to_toml(config_registry.get(name)))
    assert parse_cli(["--config-file", str(path)], registry=DEFAULT_REGISTRY).config == config_registry.get(name)
    cfg = config_registry.get(name)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model.flavor))
    assert model.num_params() > 0


@pytest.mark.parametrize("name", sorted(LOW_PRECISION))
def test_low_precision_configs_convert_the_experts_and_keep_routers_float32(name, caplog):
    cfg = config_registry.get(name)
    device_type = "cpu" if "debug" in name else "cuda"
    with caplog.at_level(logging.WARNING):
        run = resolve_run(cfg, world_size=8, device_type=device_type, cuda_available=False)
    # The published sizes compile; no shipped config warns about itself.
    assert "without torch.compile of the model is usually slower than BF16" not in caplog.text
    dense, expert_recipe = LOW_PRECISION[name]
    converters = run.converters.converters
    quantizer, experts = linear_quantizer(converters), expert_quantizer(converters)
    assert experts is not None and experts.config.recipe_name == expert_recipe
    assert (None if quantizer is None else (quantizer.kind, quantizer.plan_config.recipe_name)) == dense
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    rows = experts.plan_rows(model)
    gemms = [r for r in rows if r.experts]
    assert len(gemms) == 3 * run.model_args.n_layers and all(r.recipe == expert_recipe for r in gemms)
    assert [r.fqn for r in rows if not r.experts] == [f"layers.{i}.moe.router.gate" for i in range(run.model_args.n_layers)]
    if quantizer is not None:
        plan = {r.fqn: r for r in quantizer.plan_rows(model)}
        assert plan["layers.0.moe.router.gate"].recipe is None and plan["layers.0.attention.wq"].recipe is not None


@pytest.mark.parametrize("name", sorted(SPEED_FILTERED))
def test_published_fp8_expert_configs_keep_experts_in_bf16_where_fp8_is_predicted_slower(name):
    """At their own batch (one sequence of 4096: 256 tokens per expert) and at four sequences (1,024 per expert),
    Qwen3's experts stay BF16, for too few tokens and then for their width, and the plan says which."""
    def rows(batch: int) -> list:
        cfg = config_registry.get(name)
        cfg.training.local_batch_size = batch
        run = resolve_run(cfg, world_size=8, device_type="cuda", cuda_available=False)
        converters = run.converters.converters
        experts, quantizer = expert_quantizer(converters), linear_quantizer(converters)
        assert experts is not None and experts.config.filter_fqns == ["auto_filter_small_kn"]
        assert (None if quantizer is None else (quantizer.kind, quantizer.plan_config.recipe_name)) == \
            SPEED_FILTERED[name]
        with torch.device("meta"):
            model = run.model_spec.model_cls(run.model_args)
        gemms = [r for r in experts.plan_rows(model) if r.experts]
        assert gemms and all(r.recipe is None for r in gemms)
        return gemms

    few = rows(1)
    assert all("~256 tokens per expert (< 1024)" in r.reason for r in few)
    wide = rows(4)
    assert all("below the rowwise size rule" in r.reason for r in wide)
    # One recipe per experts module: w3 and w2 stay with w1, and say so.
    assert wide[1].reason.startswith("with w1 (one recipe per experts module): auto_filter_small_kn: K=")


def test_the_speed_filter_converts_experts_that_are_wide_enough_and_see_enough_tokens():
    """Mutation check of the rule's other side: experts above the size rule with >= 1,024 tokens each convert."""
    cfg = config_registry.get("qwen3_moe_30b_a3b_fp8")
    cfg.training.local_batch_size = 4
    cfg.model.n_layers = 1
    run = resolve_run(cfg, world_size=1, device_type="cuda", cuda_available=False)
    run.model_args.dim = 4096
    run.model_args.moe = dataclasses.replace(run.model_args.moe, hidden_dim=4096)
    experts = expert_quantizer(run.converters.converters)
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    gemms = [r for r in experts.plan_rows(model) if r.experts]
    assert [(r.in_features, r.out_features, r.recipe) for r in gemms] == [(4096, 4096, "rowwise")] * 3
