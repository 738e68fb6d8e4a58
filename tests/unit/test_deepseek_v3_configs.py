"""The DeepSeek-V3 configs: registered, complete, buildable on meta; the FP8 recipe's plan keeps what DeepSeek-V3
keeps in high precision and says why; tensor parallelism, which the family has no plan for, and expert-parallel
layouts it cannot run are refused before launch."""
from __future__ import annotations

import pytest
import torch

import config_registry
from config_registry import DEFAULT_REGISTRY
from models import build_model_args, get_model_spec
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.config import config_to_toml, parse_cli
from torchtitan_lite.resolved_run import resolve_run

NAMES = ["deepseek_v3_debug", "deepseek_v3_debug_bf16", "deepseek_v3_debug_fp8_blockwise", "deepseek_v3_16b",
         "deepseek_v3_671b_fp8"]


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trips_and_its_model_builds_on_meta(name, tmp_path):
    cfg = config_registry.get(name)
    path = tmp_path / "cfg.toml"
    path.write_text(config_to_toml(cfg))
    assert parse_cli(["--config-file", str(path)], registry=DEFAULT_REGISTRY).config == cfg
    assert cfg.model.name == "deepseek_v3"
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, cfg.model.flavor))
    assert model.num_params() > model.param_counts().active > 0


def _plan(name: str, device_type: str = "cpu") -> tuple[dict[str, str], str]:
    run = resolve_run(config_registry.get(name), world_size=1, device_type=device_type, vocab_size=2048,
                      cuda_available=False)
    spec = get_model_spec("deepseek_v3")
    with torch.device("meta"):
        model = spec.model_cls(run.model_args)
    (quantizer,) = run.converters.converters
    assert isinstance(quantizer, Float8BlockwiseConverter)
    rows = {row.fqn: row.recipe or row.reason for row in quantizer.plan_rows(model)}
    return rows, quantizer.explain(model)


def test_debug_fp8_plan_keeps_what_deepseek_v3_keeps_and_says_why():
    rows, text = _plan("deepseek_v3_debug_fp8_blockwise")
    assert rows["layers.1.moe.router.gate"] == "filter_fqns entry 'router.gate'"
    assert rows["output"] == "output projection (keep_output_hp)"
    # kv_lora_rank + qk_rope_head_dim = 160 output channels: no whole 128-row blocks, as the 671B model's 576.
    assert rows["layers.2.attention.wkv_a"].startswith("dims not multiples of 128")
    converted = sorted(fqn for fqn, recipe in rows.items() if recipe == "blockwise")
    per_block = {"0": 7, "1": 7, "2": 7, "3": 7}  # wq_a, wq_b, wkv_b, wo + the dense or shared SwiGLU's three
    assert {i: sum(f.startswith(f"layers.{i}.") for f in converted) for i in per_block} == per_block
    for part in ("tok_embeddings: embedding lookup", "layers.*.moe.router.gate: MoE gating", "attention core:",
                 "normalisation operators", "layers.*.moe.experts: routed experts run grouped GEMMs"):
        assert part in text
    assert "power-of-2 scales" in text


def test_671b_fp8_plan_converts_every_block_linear_but_the_gates_and_wkv_a():
    rows, _ = _plan("deepseek_v3_671b_fp8", device_type="cuda")
    kept = {fqn: reason for fqn, reason in rows.items() if reason != "blockwise"}
    assert set(kept) == {"output"} | {f"layers.{i}.moe.router.gate" for i in range(3, 61)} | {
        f"layers.{i}.attention.wkv_a" for i in range(61)}
    assert all(rows[f"layers.5.attention.{n}"] == "blockwise" for n in ("wq_a", "wq_b", "wkv_b", "wo"))


@pytest.mark.parametrize("args, message", [
    (["--parallelism.tp", "2"], r"deepseek_v3 does not support tensor parallelism yet \(parallelism.tp=2\)"),
    (["--compile.enable", "true"], r"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype "
                                   r"is float32"),
    (["--parallelism.ep", "2", "--activation_checkpoint.mode", "selective"],
     r"activation_checkpoint.mode=selective with selective_option=op does not work with expert parallelism "
     r"\(parallelism.ep=2\)"),
])
def test_what_the_family_cannot_run_is_refused_before_launch(args, message):
    cfg = parse_cli(["--config", "deepseek_v3_debug", *args], registry=DEFAULT_REGISTRY).config
    with pytest.raises(ValueError, match=message):
        resolve_run(cfg, world_size=2 if args[0].startswith("--parallelism") else 1, device_type="cpu",
                    vocab_size=2048, cuda_available=False)


def test_expert_parallelism_resolves():
    cfg = parse_cli(["--config", "deepseek_v3_debug", "--parallelism.ep", "2"], registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=2048, cuda_available=False)
    assert run.parallel_dims.describe() == "FSDP 2 + EP 2"
