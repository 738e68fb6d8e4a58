"""Every registered config is complete, documented and survives a TOML round trip."""
from __future__ import annotations

import logging

import pytest
import torch

import config_registry
from config_registry import DEFAULT_REGISTRY
from models import build_model_args, get_model_spec
from torchtitan_lite.config import config_to_toml, parse_cli, undocumented_fields
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer

REQUIRED = ["llama3_debug", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b", "llama3_405b",
            "llama3_debug_bf16", "llama3_debug_fp16", "llama3_debug_fp8", "llama3_debug_fp8_rowwise",
            "llama3_8b_fp8", "llama3_8b_fp8_rowwise", "llama3_70b_fp8", "llama3_405b_fp8", "llama3_8b_128k",
            "llama3_8b_128k_fp8", "llama3_debug_fp8_head", "llama3_8b_fp8_head"]


def test_required_configs_are_registered():
    assert set(REQUIRED) <= set(config_registry.names())


def test_every_config_field_is_documented():
    assert undocumented_fields(Trainer.Config) == []


@pytest.mark.parametrize("name", REQUIRED)
def test_config_round_trips_through_toml(name, tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text(config_to_toml(config_registry.get(name)))
    assert parse_cli(["--config-file", str(path)], registry=DEFAULT_REGISTRY).config == config_registry.get(name)


@pytest.mark.parametrize("name", REQUIRED)
def test_config_model_builds_on_meta(name):
    cfg = config_registry.get(name)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model.flavor))
    assert model.num_params() > 0


def test_registry_returns_fresh_objects():
    a = config_registry.get("llama3_debug")
    a.training.steps = 1
    assert config_registry.get("llama3_debug").training.steps != 1


COMPILE_WARNING = "without torch.compile of the model is usually slower than BF16"
DEBUG = [name for name in REQUIRED if "debug" in name]
PUBLISHED = [name for name in REQUIRED if "debug" not in name]


@pytest.mark.parametrize("name, device_type", [(n, "cpu") for n in REQUIRED] + [(n, "cuda") for n in PUBLISHED])
def test_no_shipped_config_warns_about_itself(name, device_type, caplog):
    # The debug configs run on CPU, where FP8 checks numerics (no compile makes it faster than BF16); the
    # published sizes run on GPUs and compile where they use FP8.
    with caplog.at_level(logging.WARNING):
        resolve_run(config_registry.get(name), world_size=8, device_type=device_type, cuda_available=False)
    assert COMPILE_WARNING not in caplog.text


@pytest.mark.parametrize("name, base", [("llama3_debug_fp8_head", "llama3_debug_fp8"), ("llama3_8b_fp8_head", "llama3_8b_fp8")])
def test_the_fp8_head_configs_differ_from_their_base_in_the_head_only(name, base):
    import dataclasses

    (head,), (kept,) = (config_registry.get(n).model_converters.converters for n in (name, base))
    assert "output" in kept.filter_fqns and kept.keep_output_hp  # the base keeps the head BF16 twice over
    assert dataclasses.replace(kept, keep_output_hp=False, filter_fqns=[f for f in kept.filter_fqns if f != "output"]) == head
    cfg, base_cfg = config_registry.get(name), config_registry.get(base)
    base_cfg.model_converters, base_cfg.job.dump_folder = cfg.model_converters, cfg.job.dump_folder
    assert cfg == base_cfg  # the plan that follows: tests/unit/test_float8_plan.py
    # docs/mixed_precision.md's flags turn the base config into this one.
    rest = "[]" if base == "llama3_debug_fp8" else "auto_filter_small_kn"
    flags = ["--model_converters.converters.0.keep_output_hp", "false", "--model_converters.converters.0.filter_fqns", rest]
    by_flags = parse_cli(["--config", base, *flags], registry=DEFAULT_REGISTRY).config
    assert by_flags.model_converters == config_registry.get(name).model_converters


def test_a_user_config_that_runs_fp8_uncompiled_on_gpus_is_warned(caplog):
    cfg = config_registry.get("llama3_8b_fp8")
    cfg.compile.enable = False
    with caplog.at_level(logging.WARNING):
        resolve_run(cfg, world_size=8, device_type="cuda", cuda_available=False)
    assert f"FP8 training {COMPILE_WARNING}" in caplog.text
