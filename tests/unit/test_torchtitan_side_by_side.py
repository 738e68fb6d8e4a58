"""scripts/torchtitan_side_by_side.py's own side, without torchtitan installed: which cases the matrix holds,
how each resolves into the settings torchtitan copies and the commands both sides run, the generated
torchtitan config per case, the layout check, what is refused, and the markdown table."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import models  # noqa: F401  (registers the model families)
from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.tools.torchtitan_side_by_side import cases, layout, runner
from torchtitan_lite.tools.torchtitan_side_by_side.report import CaseResult, report_text
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import (
    LAYOUT_PREFIX,
    parse_layout,
    torchtitan_config_source,
)


def _plan(key: str, *extra: str) -> runner.Plan:
    args, overrides = runner.parse_args(["--cases", key, *extra])
    return runner.plan_case(args.selected[0], args, overrides, DEFAULT_REGISTRY)


def test_matrix_holds_every_precision_compile_and_layout_and_cases_keep_matrix_order():
    keys = [case.key for case in cases.select_cases(None, matrix=True)]
    assert keys == ["fp32-eager", "fp32-compile", "bf16-eager", "bf16-compile", "fp32-eager-fsdp2",
                    "fp32-compile-fsdp2", "bf16-eager-fsdp2", "bf16-compile-fsdp2", "fp8-rowwise-compile",
                    "fp8-tensorwise-compile"]
    picked = cases.select_cases("bf16-compile, fp32-eager", matrix=False)
    assert [case.key for case in picked] == ["fp32-eager", "bf16-compile"]
    assert cases.select_cases(None, matrix=False) == [cases.AS_CONFIGURED]
    with pytest.raises(ValueError, match=r"unknown case\(s\) \['bf16'\]; choose from fp32-eager, fp32-compile"):
        cases.select_cases("bf16", matrix=False)
    with pytest.raises(SystemExit):
        runner.parse_args(["--matrix", "--cases", "fp32-eager"])


def test_fsdp_compile_case_resolves_to_bf16_compiled_two_rank_runs_on_both_sides(tmp_path):
    plan = _plan("bf16-compile-fsdp2")
    s = plan.settings
    assert (s.param_dtype, s.compile_components, s.dp_shard, s.float8_recipe) == ("bfloat16", ("model", "loss"), 2, None)
    assert plan.ours_cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                  "--local-ranks-filter"]
    assert plan.ours_cmd[plan.ours_cmd.index("--config"):][:8] == [
        "--config", "llama3_debug", "--precision.param_dtype", "bfloat16", "--compile.enable", "true",
        "--parallelism.dp_shard", "2"]
    plan.module = "ttl_sbs_bf16_compile_fsdp2"
    theirs = runner.torchtitan_command(Path("/venv/bin/python"), argparse.Namespace(
        steps=30, log_freq=10, run_dir=tmp_path, torchtitan_arg=[]), plan)
    assert "--nproc_per_node=2" in theirs and theirs[theirs.index("--module") + 1] == "ttl_sbs_bf16_compile_fsdp2"
    source = torchtitan_config_source(s, tokenizer_dir=tmp_path, data_dir=tmp_path)
    compile(source, "ttl_sbs_bf16_compile_fsdp2.py", "exec")
    assert "mixed_precision_param='bfloat16'" in source
    assert "compile=CompileConfig(enable=True, components=['model', 'loss'])" in source
    # torchtitan's default spmd_types backend stops in fully_shard for a purely data-parallel model.
    assert 'parallelism=ParallelismConfig(spmd_backend="partial_dtensor")' in source
    # 6 blocks x (wq, wk, wv, wo, w1, w2, w3) + output, all plain: the separate wk / wv are counted.
    assert layout.describe(plan.layout) == "5,770,496 parameters, 43 Linears"
    assert plan.layout["linears"].count(("linear", 256, 128)) == 12


def test_fp8_case_converts_the_same_linears_torchtitan_does_and_maps_the_filter(tmp_path):
    plan = _plan("fp8-rowwise-compile")
    assert (plan.settings.float8_recipe, plan.settings.float8_filter_fqns) == ("rowwise", ("output",))
    assert layout.describe(plan.layout) == "5,770,496 parameters, 43 Linears (42 float8)"
    assert ("linear", 256, 2048) in plan.layout["linears"]  # the output projection stays high precision
    source = torchtitan_config_source(plan.settings, tokenizer_dir=tmp_path, data_dir=tmp_path)
    compile(source, "ttl_sbs_fp8.py", "exec")
    assert "recipe_name='rowwise', filter_fqns=['lm_head']" in source and "model_compile_enabled=True" in source
    assert "partial_dtensor" not in source  # one process: torchtitan's default backend works


def test_layout_check_names_a_fused_key_value_projection_and_a_parameter_difference():
    ours = layout.normalise({"params": 100, "linears": [["Linear", 256, 128], ["Linear", 256, 128],
                                                        ["Float8Linear", 256, 256]]})
    log = "noise\n" + LAYOUT_PREFIX + '{"params": 100, "linears": [["Linear", 256, 128], ["Linear", 256, 128], ' \
        '["Float8Linear", 256, 256]]}\nmore noise'
    assert layout.layout_difference(ours, layout.normalise(parse_layout(log))) is None
    fused = layout.normalise({"params": 99, "linears": [["Linear", 256, 256], ["Float8Linear", 256, 256]]})
    assert layout.layout_difference(ours, fused) == (
        "parameters: torchtitan_lite 100, torchtitan 99; Linears (kind, in, out) only in torchtitan_lite: "
        "[('linear', 256, 128), ('linear', 256, 128)]; only in torchtitan: [('linear', 256, 256)] (3 vs 2 Linears)")
    assert parse_layout("no layout here") is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--activation_checkpoint.mode", "full"], "it uses activation checkpointing, which the generated torchtitan"),
    (["--precision.param_dtype", "float16"], "precision.param_dtype=float16 (torchtitan trains in float32 or"),
    (["--compile.enable", "true", "--compile.backend", "aot_eager"], "a compile backend other than inductor"),
    (["--model_converters.converters", "float8", "--model_converters.converters.0.filter_fqns", "auto_filter_small_kn"],
     "auto_filter_small_kn"),
])
def test_settings_torchtitan_cannot_copy_are_refused_before_anything_runs(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _plan("fp32-eager", *flags)
    assert "error: case fp32-eager (--config llama3_debug" in str(exit_info.value)
    assert message in str(exit_info.value)


def test_float8_filters_without_a_torchtitan_name_are_refused():
    plan = _plan("fp32-eager", "--model_converters.converters", "float8",
                 "--model_converters.converters.0.filter_fqns", "wq")
    with pytest.raises(ValueError, match=r"float8 filter_fqns \['wq'\] have no torchtitan equivalent here; the side "
                                         r"by side maps only \['output'\]"):
        torchtitan_config_source(plan.settings, tokenizer_dir=Path("t"), data_dir=Path("d"))


def test_report_has_ratio_spread_load_and_commands_per_case(monkeypatch):
    plan = _plan("bf16-eager")
    result = CaseResult(plan.case, plan.settings, plan.layout, plan.ours_cmd, ["tt", "--module", "m"],
                        ours=[1100.0, 1000.0], theirs=[1000.0, 1000.0], loads=[0.5, 1.25])
    monkeypatch.setattr(sys, "argv", ["torchtitan_side_by_side.py", "--cases", "bf16-eager"])
    args = argparse.Namespace(config="llama3_debug", steps=30, warmup=10, log_freq=10, repeats=2)
    text = report_text(args, {"torchtitan": "0.3.0", "torch": "2.13.0", "torchao": "0.18.0"}, [result],
                       {"fp8-tensorwise-compile": "no tensorwise recipe"})
    # best 1100 / best 1000; repeats 1100/1000 and 1000/1000.
    assert ("| bf16-eager | `--precision.param_dtype bfloat16` | 5,770,496 parameters, 43 Linears | 1,000 (1,000, "
            "1,000) | 1,100 (1,100, 1,000) | **1.10x** | 1.00-1.10 | 0.5-1.2 |") in text
    assert "| fp8-tensorwise-compile | | | not run: no tensorwise recipe |" in text
    assert "- bf16-eager: torchtitan `tt --module m`; torchtitan_lite `" in text
    assert "fastest of 2 interleaved runs per trainer" in text
