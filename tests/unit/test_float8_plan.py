"""FP8 plan: which Linear gets which recipe and why; agreement with torchao's auto filter; the table."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn as nn
from _conversion import context
from torchao.float8 import _auto_filter_for_recipe
from torchao.float8.float8_linear import Float8Linear

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.float8_plan import (
    PlanRow,
    float8_plan,
    format_float8_plan,
    format_plan_summary,
    skip_reason,
)
from torchtitan_lite.config import parse_cli
from torchtitan_lite.resolved_run import resolve_run


def _tiny_llama_like() -> nn.Module:
    with torch.device("meta"):
        block = nn.ModuleDict({
            "attention": nn.ModuleDict({"wq": nn.Linear(64, 64, bias=False)}),
            "feed_forward": nn.ModuleDict({"w1": nn.Linear(64, 24, bias=False)}),
        })
        return nn.ModuleDict({"layers": nn.ModuleDict({"0": block}), "output": nn.Linear(64, 256, bias=False)})


def _meta(shapes: dict[str, tuple[int, int]]) -> nn.Module:
    with torch.device("meta"):
        return nn.ModuleDict({name: nn.Linear(k, n, bias=False) for name, (k, n) in shapes.items()})


def _plan(model, **fields):
    config = Float8LinearConverter.Config(**fields)
    return {row.fqn: (row.recipe, row.reason) for row in float8_plan(model, config, output_module="output", blocks="layers")}


def test_plan_without_filters_converts_every_aligned_linear_but_the_output_projection():
    assert _plan(_tiny_llama_like()) == {
        "layers.0.attention.wq": ("tensorwise", ""),
        "layers.0.feed_forward.w1": (None, "dims not divisible by 16"),
        "output": (None, "output projection (keep_output_hp)"),
    }
    assert _plan(_tiny_llama_like(), keep_output_hp=False)["output"] == ("tensorwise", "")


def test_plan_with_filter_fqns_skips_matching_names():
    assert _plan(_tiny_llama_like(), filter_fqns=["output"], recipe_name="rowwise") == {
        "layers.0.attention.wq": ("rowwise", ""),
        "layers.0.feed_forward.w1": (None, "dims not divisible by 16"),
        "output": (None, "filter_fqns entry 'output'"),
    }
    # Substring match: 'attention' catches every projection under it.
    assert _plan(_tiny_llama_like(), filter_fqns=["attention"])["layers.0.attention.wq"] == (
        None, "filter_fqns entry 'attention'")


def test_auto_filter_tensorwise_thresholds():
    # torchao tensorwise rule: skip when K <= 4096 and N <= 1024 (K = in_features, N = out_features).
    model = _meta({"keep_wide_n": (16, 1040), "skip_edge": (4096, 1024), "keep_deep_k": (4112, 16)})
    assert _plan(model, filter_fqns=["auto_filter_small_kn"]) == {
        "keep_wide_n": ("tensorwise", ""),
        "skip_edge": (None, "too small for tensorwise per auto_filter_small_kn (K=4096, N=1024)"),
        "keep_deep_k": ("tensorwise", ""),
    }


def test_auto_filter_rowwise_thresholds():
    # torchao rowwise rule: skip when N <= 2048, or K <= 1024, or (N <= 4096 and K <= 2048).
    model = _meta({"keep": (1040, 4112), "keep_mid": (2064, 2064), "small_n": (4096, 2048),
                   "small_k": (1024, 8192), "small_both": (2048, 4096)})
    assert _plan(model, recipe_name="rowwise", filter_fqns=["auto_filter_small_kn"]) == {
        "keep": ("rowwise", ""),
        "keep_mid": ("rowwise", ""),
        "small_n": (None, "too small for rowwise per auto_filter_small_kn (K=4096, N=2048)"),
        "small_k": (None, "too small for rowwise per auto_filter_small_kn (K=1024, N=8192)"),
        "small_both": (None, "too small for rowwise per auto_filter_small_kn (K=2048, N=4096)"),
    }


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_filter_agrees_with_torchao_on_a_grid_of_shapes(recipe):
    dims = [24, 16, 1008, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    torchao_filter = _auto_filter_for_recipe(recipe, ["output"])
    with torch.device("meta"):
        for fqn in ("layers.0.w", "output"):
            for k in dims:
                for n in dims:
                    module = nn.Linear(k, n, bias=False)
                    ours = skip_reason(fqn, k, n, recipe_name=recipe, filter_fqns=["output", "auto_filter_small_kn"])
                    assert (ours == "") == torchao_filter(module, fqn), (fqn, k, n, ours)


def test_converter_swaps_exactly_the_planned_modules_and_leaves_its_config_alone():
    config = Float8LinearConverter.Config(filter_fqns=["output"])
    before = dataclasses.asdict(config)
    model = _tiny_llama_like()
    converter = config.build(context=context())
    converter.convert(model)
    swapped = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == {"layers.0.attention.wq"}
    assert [row.fqn for row in converter.plan if row.recipe] == ["layers.0.attention.wq"]
    assert dataclasses.asdict(config) == before
    # After conversion the plan of the converted model is unchanged (Float8Linear is an nn.Linear).
    assert float8_plan(model, config, output_module="output", blocks="layers") == converter.plan


@pytest.mark.parametrize("fields, model_fn, expected", [
    ({"keep_output_hp": False}, _tiny_llama_like, {"layers.0.attention.wq", "output"}),
    ({}, _tiny_llama_like, {"layers.0.attention.wq"}),
    ({"filter_fqns": ["output"]}, _tiny_llama_like, {"layers.0.attention.wq"}),
    ({"filter_fqns": ["auto_filter_small_kn"]},
     lambda: _meta({"keep_wide_n": (16, 1040), "skip_edge": (4096, 1024), "keep_deep_k": (4112, 16)}),
     {"keep_wide_n", "keep_deep_k"}),
    ({"recipe_name": "rowwise", "filter_fqns": ["auto_filter_small_kn"]},
     lambda: _meta({"keep": (1040, 4112), "small_n": (4096, 2048), "small_both": (2048, 4096)}),
     {"keep"}),
])
def test_conversion_on_the_meta_model_swaps_exactly_the_expected_linears(fields, model_fn, expected):
    model = model_fn()
    Float8LinearConverter.Config(**fields).build(context=context()).convert(model)
    swapped = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    untouched = {fqn for fqn, m in model.named_modules() if type(m) is nn.Linear}
    assert swapped == expected
    assert swapped.isdisjoint(untouched) and len(swapped | untouched) == sum(
        isinstance(m, nn.Linear) for m in model.modules())


def test_table_lists_every_linear_and_the_fp8_share_of_linear_flops():
    rows = float8_plan(_tiny_llama_like(), Float8LinearConverter.Config(filter_fqns=["output"]), output_module="output",
                       blocks="layers")
    table = format_float8_plan(rows)
    assert table.splitlines() == [
        "FP8 plan: 1 of 3 Linear layers run in FP8",
        "fqn                       in  out  fp8 recipe  skipped because",
        "layers.0.attention.wq     64   64  tensorwise",
        "layers.0.feed_forward.w1  64   24  -           dims not divisible by 16",
        "output                    64  256  -           filter_fqns entry 'output'",
        # 6*64*64 / (6*64*64 + 6*64*24 + 6*64*256) = 4096 / 22016 = 18.6%
        "FP8 share: 18.6% of all Linear matmul FLOPs (attention and other ops not counted); "
        "Linear FLOPs counted as 6*in*out per token (fwd+bwd)",
    ]


def test_table_share_relative_to_model_flops_when_given():
    rows = float8_plan(_tiny_llama_like(), Float8LinearConverter.Config(filter_fqns=["output"]), output_module="output",
                       blocks="layers")
    last = format_float8_plan(rows, seq_len=32, total_flops_per_token=245760).splitlines()[-1]
    # 6*64*64 = 24576 of 245760 model FLOPs per token = 10.0%
    assert last.startswith("FP8 share: 10.0% of the model's training FLOPs per token at seq_len 32 (attention included)")


def test_converter_explain_uses_the_models_flops_per_token(caplog):
    model = _tiny_llama_like()
    model.flops_per_token = lambda seq_len: 24576 * 4 if seq_len == 32 else 0.0
    converter = Float8LinearConverter.Config(filter_fqns=["output"]).build(context=context())
    with caplog.at_level("INFO", logger="torchtitan_lite"):
        converter.convert(model)
    text = converter.explain(model)
    assert text.startswith("float8 converter (recipe tensorwise, FSDP float8 all-gather off, precomputed scales off)\n"
                           "FP8 plan: 1 of 3 Linear layers run in FP8")
    assert "FP8 share: 25.0% of the model's training FLOPs per token at seq_len 32" in text
    assert "FP8 plan" not in caplog.text  # the launch logs a summary, --print-fp8-plan / --dry-run the table


def test_explain_accepts_explicit_seq_len_and_flops_and_reports_inactive_all_gather():
    config = Float8LinearConverter.Config(filter_fqns=["output"], enable_fsdp_float8_all_gather=True,
                                          precompute_float8_dynamic_scale_for_fsdp=True)
    text = config.build(context=context()).explain(_tiny_llama_like(), seq_len=8192,
                                                                 total_flops_per_token=24576 * 2)
    assert text.splitlines()[0] == ("float8 converter (recipe tensorwise, FSDP float8 all-gather off (no FSDP "
                                    "sharding), precomputed scales off (no FSDP sharding))")
    assert "FP8 share: 50.0% of the model's training FLOPs per token at seq_len 8192" in text
    sharded = config.build(context=context(fsdp=True)).explain(_tiny_llama_like())
    assert sharded.splitlines()[0] == "float8 converter (recipe tensorwise, FSDP float8 all-gather on, precomputed scales on)"


def _blocks(n: int, head: str = "output", container: str = "layers") -> nn.Module:
    with torch.device("meta"):
        layers = nn.ModuleDict({str(i): nn.ModuleDict({"w": nn.Linear(64, 64, bias=False)}) for i in range(n)})
        return nn.ModuleDict({container: layers, head: nn.Linear(64, 256, bias=False)})


def test_first_and_last_blocks_stay_in_high_precision_and_filters_are_named_first():
    assert _plan(_blocks(4), keep_first_blocks_hp=1, keep_last_blocks_hp=2, filter_fqns=["layers.3"]) == {
        "layers.0.w": (None, "block 0 of the first 1 (keep_first_blocks_hp)"),
        "layers.1.w": ("tensorwise", ""),
        "layers.2.w": (None, "block 2 of the last 2 (keep_last_blocks_hp)"),
        "layers.3.w": (None, "filter_fqns entry 'layers.3'"),
        "output": (None, "output projection (keep_output_hp)"),
    }


def test_the_edge_blocks_are_found_in_the_container_the_context_names():
    # A family whose plan names its blocks "h" (ParallelPlan.blocks): the edges are h.0 / h.2, not a "layers".
    model = _blocks(3, container="h")
    converter = Float8LinearConverter.Config(keep_first_blocks_hp=1, keep_last_blocks_hp=1).build(
        context=dataclasses.replace(context(), blocks="h"))
    converter.convert(model)
    assert {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)} == {"h.1.w"}
    with pytest.raises(ValueError, match="blocks in model.h, and ModuleDict has none"):
        Float8LinearConverter.Config(keep_first_blocks_hp=1).build(
            context=dataclasses.replace(context(), blocks="h")).convert(_blocks(3))


def test_the_output_projection_is_the_one_the_context_names():
    model = _blocks(2, head="lm_head")
    converter = Float8LinearConverter.Config().build(context=dataclasses.replace(context(), output_module="lm_head"))
    converter.convert(model)
    assert {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)} == {"layers.0.w", "layers.1.w"}


@pytest.mark.parametrize("fields, model_fn, message", [
    ({"keep_first_blocks_hp": 2, "keep_last_blocks_hp": 1}, lambda: _blocks(3),
     "keep_first_blocks_hp=2 \\+ keep_last_blocks_hp=1 keep all 3 blocks in high precision"),
    ({"keep_first_blocks_hp": 1}, lambda: _meta({"w": (64, 64)}), "need the model's transformer blocks in model.layers"),
])
def test_edges_that_cannot_apply_are_errors(fields, model_fn, message):
    converter = Float8LinearConverter.Config(**fields).build(context=context())
    with pytest.raises(ValueError, match=message):
        converter.convert(model_fn())


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_edge_counts_must_be_non_negative_integers(value):
    with pytest.raises(ValueError, match=r"keep_last_blocks_hp=.* must be a non-negative integer"):
        Float8LinearConverter.Config(keep_last_blocks_hp=value)


@pytest.mark.parametrize("kind, recipe", [("float8", "tensorwise"), ("mx", "mxfp8")])
def test_a_converter_added_on_the_command_line_keeps_the_output_projection_unless_asked(kind, recipe):
    def output_row(*extra: str) -> tuple[str | None, str]:
        cli = parse_cli(["--config", "llama3_debug_bf16", "--model_converters.converters", kind, *extra],
                        registry=DEFAULT_REGISTRY)
        run = resolve_run(cli.config, world_size=1, device_type="cpu")
        with torch.device("meta"):
            model = run.model_spec.model_cls(run.model_args)
        converter = run.converters.converters[0]
        rows = float8_plan(model, converter.config, output_module=run.model_spec.parallel_plan.output,
                           blocks=run.model_spec.parallel_plan.blocks)
        return next((r.recipe, r.reason) for r in rows if r.fqn == "output")

    assert output_row() == (None, "output projection (keep_output_hp)")
    assert output_row("--model_converters.converters.0.keep_output_hp", "false") == (recipe, "")


@pytest.mark.parametrize("name, base, world_size, device_type", [
    ("llama3_debug_fp8_head", "llama3_debug_fp8", 1, "cpu"), ("llama3_8b_fp8_head", "llama3_8b_fp8", 8, "cuda")])
def test_the_fp8_head_configs_convert_the_output_projection_and_nothing_else(name, base, world_size, device_type):
    def plan_of(config: str) -> dict[str, tuple[str | None, str]]:
        run = resolve_run(DEFAULT_REGISTRY.get(config), world_size=world_size, device_type=device_type,
                          cuda_available=False)
        with torch.device("meta"):
            model = run.model_spec.model_cls(run.model_args)
        rows = float8_plan(model, run.converters.converters[0].config, output_module=run.model_spec.parallel_plan.output,
                           blocks=run.model_spec.parallel_plan.blocks)
        return {r.fqn: (r.recipe, r.reason) for r in rows}

    head, kept = plan_of(name), plan_of(base)
    assert kept.pop("output") == (None, "filter_fqns entry 'output'")
    assert head.pop("output") == ("tensorwise", "")
    assert head == kept


def test_plan_summary_counts_recipes_and_skip_reasons_and_names_the_edges():
    rows = [PlanRow("layers.0.attention.wq", 4096, 4096, None, "block 0 of the first 1 (keep_first_blocks_hp)"),
            PlanRow("layers.0.feed_forward.w1", 4096, 14336, None, "block 0 of the first 1 (keep_first_blocks_hp)"),
            PlanRow("layers.1.attention.wq", 4096, 4096, "rowwise", ""),
            PlanRow("layers.1.attention.wk", 4096, 1024, None,
                    "too small for rowwise per auto_filter_small_kn (K=4096, N=1024)"),
            PlanRow("layers.1.attention.wv", 4096, 1024, None,
                    "too small for rowwise per auto_filter_small_kn (K=4096, N=1024)"),
            PlanRow("layers.1.feed_forward.w1", 4096, 14336, "rowwise", ""),
            PlanRow("layers.2.attention.wq", 4096, 4096, None, "block 2 of the last 1 (keep_last_blocks_hp)"),
            PlanRow("output", 4096, 128256, None, "output projection (keep_output_hp)")]
    # Linear FLOPs per token 6*in*out: rowwise 6*4096*(4096+14336) of 6*4096*(3*4096+2*14336+2*1024+128256) = 10.8%.
    assert format_plan_summary(rows).splitlines() == [
        "FP8 plan: 2 of 8 Linear layers run in FP8 (2 rowwise); high precision: 2 in the first 1 block(s) "
        "(keep_first_blocks_hp); 2 too small for rowwise per auto_filter_small_kn; 1 in the last 1 block(s) "
        "(keep_last_blocks_hp); 1 output projection (keep_output_hp)",
        "high-precision edges: layers.0, layers.2, output",
        "FP8 share: 10.8% of all Linear matmul FLOPs (attention and other ops not counted); Linear FLOPs counted as "
        "6*in*out per token (fwd+bwd)",
        "every Linear with its recipe or skip reason: --print-fp8-plan",
    ]


def test_converting_logs_no_plan_and_a_dry_run_prints_the_table_once(caplog):
    from torchtitan_lite.dry_run import dry_run_text

    cfg = parse_cli(["--config", "llama3_debug_fp8", "--model.n_layers", "1"], registry=DEFAULT_REGISTRY).config
    run = resolve_run(cfg, world_size=2, device_type="cpu")
    with caplog.at_level(logging.INFO):
        text = dry_run_text(run, cfg.precision, detail=True)
    assert "FP8 plan:" not in caplog.text
    assert text.count("FP8 plan: 7 of 8 Linear layers run in FP8") == 1 and text.count("skipped because") == 1
    # Without detail, the plan's summary: no table, and the flag that brings it.
    summary = dry_run_text(run, cfg.precision)
    assert summary.count("FP8 plan: 7 of 8 Linear layers run in FP8") == 1 and "skipped because" not in summary
    assert "every Linear with its recipe or skip reason: --dry-run-detail" in summary
