"""The DeepSeek-V3 configs: registered, complete, buildable on meta; the FP8 recipe's plan keeps what DeepSeek-V3
keeps in high precision and says why, and runs the routed experts blockwise too; its tensor-parallel plan splits
latent attention by heads and keeps the down-projections whole; layouts it cannot run are refused before launch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import config_registry
from config_registry import DEFAULT_REGISTRY
from models import build_model_args, get_model_spec
from models.deepseek_v3.parallelize import check_deepseek_v3_run
from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter
from torchtitan_lite.components.quantization.moe_experts import GroupedExpertsConverter
from torchtitan_lite.config import config_to_toml, parse_cli
from torchtitan_lite.distributed.tensor_parallel import tp_communication_text
from torchtitan_lite.protocols.model_spec import RunFacts
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


def _plan(name: str, device_type: str = "cpu", experts: bool = False) -> tuple[dict[str, str], str]:
    """(fqn -> recipe or reason, explain text) of the recipe's Linear converter, or with ``experts`` of its
    grouped-experts converter."""
    run = resolve_run(config_registry.get(name), world_size=1, device_type=device_type, vocab_size=2048,
                      cuda_available=False)
    spec = get_model_spec("deepseek_v3")
    with torch.device("meta"):
        model = spec.model_cls(run.model_args)
    linears, grouped = run.converters.converters
    assert isinstance(linears, Float8BlockwiseConverter) and isinstance(grouped, GroupedExpertsConverter)
    quantizer = grouped if experts else linears
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


@pytest.mark.parametrize("name", ["deepseek_v3_debug_fp8_blockwise", "deepseek_v3_671b_fp8"])
def test_fp8_recipe_runs_the_routed_experts_blockwise_with_power_of_2_scales(name):
    # 671B's Linears take float32 scales (torchao's kernels); its experts, emulated, power-of-2 ones: exact in
    # bfloat16, so their grouped GEMMs stay bfloat16 and compile.
    scales = "power-of-2 scales"
    rows, text = _plan(name, experts=True)
    moe_blocks = range(1, 4) if "debug" in name else range(3, 61)
    assert {fqn: recipe for fqn, recipe in rows.items() if ".experts." in fqn} == {
        f"layers.{i}.moe.experts.{w}": "blockwise" for i in moe_blocks for w in ("w1", "w3", "w2")}
    assert all(rows[f"layers.{i}.moe.router.gate"].startswith("router gate: float32 in every recipe")
               for i in moe_blocks)
    assert f"128x128 blocks of each expert's weight, {scales}), token groups padded to 128 rows" in text
    # Emulated on any device: power-of-2 scales are not torchao's (its blockwise kernels' scales are float32).
    assert "grouped GEMMs emulated: cpu has no blockwise grouped GEMM kernel" in text
    assert "power_of_2_scales=true: torchao's blockwise kernels compute float32 scales 448 / amax" in text
    assert "GEMM in the compute dtype (power-of-2 scales are exact in it)" in text


def test_671b_fp8_plan_converts_every_block_linear_but_the_gates_and_wkv_a():
    rows, _ = _plan("deepseek_v3_671b_fp8", device_type="cuda")
    kept = {fqn: reason for fqn, reason in rows.items() if reason != "blockwise"}
    assert set(kept) == {"output"} | {f"layers.{i}.moe.router.gate" for i in range(3, 61)} | {
        f"layers.{i}.attention.wkv_a" for i in range(61)}
    assert all(rows[f"layers.5.attention.{n}"] == "blockwise" for n in ("wq_a", "wq_b", "wkv_b", "wo"))


@pytest.mark.parametrize("name, args, world_size, message", [
    ("deepseek_v3_debug", ["--parallelism.tp", "3"], 3,
     r"parallelism.tp=3 must divide the model's n_heads=4 \(each rank computes whole attention heads\)"),
    ("deepseek_v3_debug", ["--compile.enable", "true"], 1,
     r"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is float32"),
    ("deepseek_v3_debug", ["--parallelism.ep", "2", "--activation_checkpoint.mode", "selective"], 2,
     r"activation_checkpoint.mode=selective with selective_option=op does not work with expert parallelism "
     r"\(parallelism.ep=2\)"),
])
def test_what_the_family_cannot_run_is_refused_before_launch(name, args, world_size, message):
    cfg = parse_cli(["--config", name, *args], registry=DEFAULT_REGISTRY).config
    with pytest.raises(ValueError, match=message):
        resolve_run(cfg, world_size=world_size, device_type="cpu", vocab_size=2048, cuda_available=False)


def test_blockwise_fp8_refuses_a_tp_split_that_cuts_its_tiles():
    cfg = parse_cli(["--config", "deepseek_v3_debug_fp8_blockwise", "--parallelism.tp", "2"],
                    registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=2048, cuda_available=False)
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    quantizer, experts = run.converters.converters
    # wo reads n_heads x v_head_dim = 128 channels: 64 per TP rank, half a blockwise tile. The replicated
    # wq_a is not split, and wq_b / wkv_b keep 128 output rows per rank.
    with pytest.raises(ValueError, match=r"layers.\{0,1,2,3\}.attention.wo \(128 -> 256, row-wise: in_features 128 / 2 = 64\)"):
        quantizer.plan_rows(model)
    # So do the routed experts' hidden 128 under expert tensor parallelism.
    with pytest.raises(ValueError, match=r"layers.\{1,2,3\}.moe.experts.w1 \(8 experts, 256 -> 128, expert TP splits "
                                         r"out_features 128 / 2 = 64\)"):
        experts.plan_rows(model)


def test_dense_blocks_hidden_dim_must_split_over_tp():
    args = dataclasses.replace(build_model_args(get_model_spec("deepseek_v3"), "debug"), dense_hidden_dim=100)
    facts = RunFacts(model_args=args, compile_model=False, param_dtype=torch.float32, tp=8)
    with pytest.raises(ValueError, match=r"parallelism.tp=8 must divide the dense blocks' dense_hidden_dim=100"):
        check_deepseek_v3_run(facts)


def test_tensor_parallel_plan_splits_latent_attention_by_heads_and_keeps_its_down_projections_whole():
    cfg = parse_cli(["--config", "deepseek_v3_debug", "--parallelism.tp", "2"], registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=2048, cuda_available=False)
    assert run.parallel_dims.describe() == "TP 2"
    plan = run.model_spec.parallel_plan
    dims = {name: plan.param_tp_shard_dim(f"layers.1.{name}") for name in (
        "attention.wq_a.weight", "attention.q_norm.weight", "attention.wkv_a.weight", "attention.kv_norm.weight",
        "attention.wq_b.weight", "attention.wkv_b.weight", "attention.wo.weight", "moe.router.gate.weight",
        "moe.experts.w1", "moe.experts.w2", "moe.shared_experts.w1.weight", "moe.shared_experts.w2.weight")}
    assert dims == {
        "attention.wq_a.weight": None, "attention.q_norm.weight": None, "attention.wkv_a.weight": None,
        "attention.kv_norm.weight": None, "attention.wq_b.weight": 0, "attention.wkv_b.weight": 0,
        "attention.wo.weight": 1, "moe.router.gate.weight": None, "moe.experts.w1": 1, "moe.experts.w2": 2,
        "moe.shared_experts.w1.weight": 0, "moe.shared_experts.w2.weight": 1}
    assert plan.param_tp_shard_dim("layers.0.feed_forward.w1.weight") == 0
    assert plan.param_tp_shard_dim("layers.0.feed_forward.w2.weight") == 1
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    text = tp_communication_text(plan, model, tp=2, high_precision=torch.bfloat16)
    # One dense block, then three MoE blocks; the attention input is gathered in high precision for the
    # replicated down-projections.
    assert text.splitlines() == [
        "TP 2 communication per block (4 blocks):",
        "  attention input          bfloat16  (attention.wq_a, attention.wkv_a replicated; every block)",
        "  feed_forward input       bfloat16  (feed_forward.w1, feed_forward.w3 not tensorwise float8; 1 of 4 blocks)",
        "  attention.wo output      bfloat16  (not tensorwise float8; every block)",
        "  feed_forward.w2 output   bfloat16  (not tensorwise float8; 1 of 4 blocks)",
        "  moe input                bfloat16  (the router reads it in float32; 3 of 4 blocks)",
        "  moe output               bfloat16  (partial sums of the experts; 3 of 4 blocks)",
    ]


def test_expert_parallelism_resolves():
    cfg = parse_cli(["--config", "deepseek_v3_debug", "--parallelism.ep", "2"], registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=2048, cuda_available=False)
    assert run.parallel_dims.describe() == "FSDP 2 + EP 2"
