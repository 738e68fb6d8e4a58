"""The Qwen3-MoE registry configs with low-precision experts: registered, complete, and converting what they say."""
from __future__ import annotations

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
       "qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8", "qwen3_moe_235b_a22b", "qwen3_moe_235b_fp8"]
# config -> (dense Linear converter and recipe, expert recipe)
LOW_PRECISION = {
    "qwen3_moe_debug_fp8": (("float8", "rowwise"), "rowwise"),
    "qwen3_moe_debug_mxfp8": (("mx", "mxfp8"), "mxfp8"),
    "qwen3_moe_30b_a3b_fp8": (None, "rowwise"),
    "qwen3_moe_235b_fp8": (("float8", "rowwise"), "rowwise"),
}


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
