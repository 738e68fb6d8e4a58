"""scripts/gpu_check.sh: the plan without a GPU, the refusal without CUDA, and the figures read from each stage."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.tools import gpu_check
from torchtitan_lite.tools import gpu_check_figures as figures
from torchtitan_lite.tools.benchmark import runner as benchmark

REPO = Path(__file__).resolve().parents[2]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, TTL_PYTHON=sys.executable), timeout=600)


def test_plan_lists_stages_a_to_g_and_their_commands_within_the_budget(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"")
    result = _script("--plan", "--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "w"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stages = [line for line in lines if line.startswith("# stage ")]
    assert [s.split(":")[0] for s in stages] == [f"# stage {k}" for k in "abcdefg"]
    assert [s.endswith("needs 2 GPUs, skipped on a machine with fewer)") for s in stages] == [False] * 5 + [True] * 2
    commands = [line for line in lines if not line.startswith("#")]
    assert len(commands) == 8  # the wheel install, then one command per stage
    assert commands[0].startswith(f"{sys.executable} -m pip install --no-index --no-deps")
    assert "-m pytest -m gpu tests/gpu" in commands[1]
    assert ("scripts/float8_layer_bench.py --shapes llama3_8b --recipes tensorwise rowwise rowwise_with_gw_hp "
            "blockwise") in commands[2]
    assert ("scripts/benchmark.py --configs llama3_8b llama3_8b_fp8 llama3_8b_fp8_rowwise --baseline llama3_8b"
            in commands[3])
    assert "--model.n_layers 4 --training.seq_len 8192" in commands[3] and "--compile.enable true" in commands[3]
    assert ("scripts/loss_compare.py --configs llama3_debug_bf16 llama3_debug_fp8 --steps 200 --seeds 3 --parallel 6"
            in commands[4])
    assert commands[6].startswith("env NGPU=2 ") and "run_train.sh --config llama3_debug --parallelism.pp 2" in commands[6]
    assert "scripts/pipeline_bubble.py --device cuda --pp 2 " in commands[7]
    assert f"output under {tmp_path / 'out'}" in lines[0]
    assert ("one-GPU stage limits add up to 1060 s, stages needing 2+ GPUs add 240 s where they run; one device "
            "command of 540 s fits --stages ade (520 s), --stages bc (540 s) (the same --out merges them)") in lines[0]


def test_the_command_groups_cover_every_one_gpu_stage_once_each_within_the_budget():
    single_gpu = [s.key for s in gpu_check.build_stages("python", Path("/out")) if s.gpus == 1]
    assert sorted("".join(gpu_check.COMMAND_GROUPS)) == sorted(single_gpu)
    assert all(gpu_check.group_limit(g) <= gpu_check.BUDGET_S for g in gpu_check.COMMAND_GROUPS)
    # A group below the budget shares out the rest; all five keep their measured limits (never cut).
    stages = gpu_check.build_stages("python", Path("/out"))
    ade = {s.key: s.timeout_s for s in gpu_check.select_stages(stages, "ade")}
    assert sum(ade.values()) <= gpu_check.BUDGET_S and all(ade[s.key] >= s.timeout_s for s in stages if s.key in ade)
    assert {s.key: s.timeout_s for s in gpu_check.select_stages(stages, "abcde")} == {
        s.key: s.timeout_s for s in stages if s.gpus == 1}


def test_stage_b_recipes_are_the_benchmarks_own():
    from torchtitan_lite.tools import float8_layer_bench

    command = gpu_check.build_stages("python", Path("/out"))[1].command
    args = float8_layer_bench.parse_args(command[2:])
    assert args.shapes == ["llama3_8b"] and args.recipes == ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"]
    float8_layer_bench.check_blockwise_shapes(float8_layer_bench.parse_shapes(args.shapes, args.tokens))  # 8B: whole blocks


def test_stage_c_overrides_resolve_for_every_benchmarked_config():
    command = gpu_check.build_stages("python", Path("/out"))[2].command
    args, overrides = benchmark.parse_args(command[2:])
    configs = benchmark._resolve(args.configs, overrides, DEFAULT_REGISTRY)
    for cfg in configs.values():
        # No network on a GPU machine: the embedded corpus and byte tokens, not the hub corpus and tokenizer.
        assert (cfg.model.n_layers, cfg.training.seq_len, cfg.compile.enable, cfg.data.dataset, cfg.tokenizer.path) == (
            4, 8192, True, "embedded", None)


def test_stage_e_benchmarks_the_moe_family_at_30b_width_on_one_gpu():
    command = gpu_check.build_stages("python", Path("/out"))[4].command
    args, overrides = benchmark.parse_args(command[2:])
    configs = benchmark._resolve(args.configs, overrides, DEFAULT_REGISTRY)
    assert list(configs) == ["qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8"]
    for cfg in configs.values():
        assert (cfg.model.name, cfg.model.flavor, cfg.model.n_layers) == ("qwen3_moe", "30B-A3B", 2)
        assert (cfg.training.seq_len, cfg.compile.enable, cfg.data.dataset, cfg.tokenizer.path) == (
            4096, False, "embedded", None)
    kinds = [c.kind for c in configs["qwen3_moe_30b_a3b_fp8"].model_converters.converters]
    assert kinds == ["moe_experts"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_and_points_to_plan(tmp_path):
    result = _script("--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "sees no CUDA device" in result.stderr and "Use --plan to see what it would run" in result.stderr
    assert not (tmp_path / "out").exists()  # a refused check writes nothing


def test_figures_from_stage_outputs(tmp_path):
    (tmp_path / "a_pytest.xml").write_text(
        '<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="2" tests="13"></testsuite></testsuites>')
    assert figures.pytest_figure(tmp_path, "") == (True, "11 passed, 0 failed, 0 errors, 2 skipped")
    (tmp_path / "a_pytest.xml").write_text('<testsuite errors="0" failures="0" skipped="3" tests="3"></testsuite>')
    assert figures.pytest_figure(tmp_path, "")[0] is False  # nothing ran on a GPU machine: a failure

    bench_log = ("| layer | M | K | N | bfloat16 ms | bfloat16 TFLOP/s | tensorwise ms | tensorwise speedup | "
                 "rowwise ms | rowwise speedup |\n|---|---:|\n| all (sum) | | | | 10.0 | | 7.0 | 1.43x | 8.0 | 1.25x |\n")
    assert figures.layer_bench_figure(tmp_path, bench_log) == (
        True, "sum of the 8B Linears, FP8 over BF16: tensorwise 1.43x, rowwise 1.25x")
    emulated = "blockwise: blockwise GEMMs emulated: NVIDIA L40S (compute capability 8.9) is not ...\n" + bench_log
    assert figures.layer_bench_figure(tmp_path, emulated)[1].endswith(
        "rowwise 1.25x (blockwise emulated on this GPU: not the kernels' speed)")

    row = dict(tokens_per_s_device=10000.0, tflops_device=400.0, mfu_percent=40.4, peak_memory_gib=30.0,
               compile_s=50.0)
    rows = [dict(row, config="llama3_8b", speedup=1.0),
            dict(row, config="llama3_8b_fp8", speedup=1.2, mfu_percent=48.0),
            dict(row, config="llama3_8b_fp8_rowwise", speedup=1.1, mfu_percent=None, compile_s=None)]
    (tmp_path / "c_benchmark.json").write_text(json.dumps({"rows": rows}))
    ok, figure = figures.benchmark_figure("c_benchmark.json")(tmp_path, "")
    assert ok and figure.startswith("llama3_8b: 10,000 tok/s, 400 TFLOP/s, MFU 40.4%, 30.0 GiB, compile 50 s, 1.00x; ")
    assert "llama3_8b_fp8_rowwise: 10,000 tok/s, 400 TFLOP/s, MFU n/a, 30.0 GiB, 1.10x" in figure
    assert figure.endswith("target FP8 tensorwise >= 1.25x: MISSED, target BF16 MFU >= 40%: met")

    loss_log = ("baseline llama3_debug_bf16; mean over the last 20 common steps (181..200):\n"
                "  llama3_debug_bf16: mean |gap| 0.0000, mean gap +0.0000, final gap +0.0000 -> ok\n"
                "  llama3_debug_fp8: mean |gap| 0.0123, mean gap +0.0100, final gap +0.0090 -> ok\n")
    ok, figure = figures.loss_figure(tmp_path, loss_log)
    assert ok and "llama3_debug_fp8 mean |loss gap| 0.0123 nats (ok)" in figure
    seeds_log = ("baseline llama3_debug_bf16 over 3 seeds; window: the last 20 common steps (181..200); noise band "
                 "(its seed-to-seed std. dev.) 0.3616:\n"
                 "  llama3_debug_fp8: mean gap -0.0663 ± 0.0757 (seeds 0 -0.2175, 1 +0.0052, 2 +0.0135) -> within noise\n")
    assert figures.loss_figure(tmp_path, seeds_log) == (
        True, "llama3_debug_fp8 mean loss gap -0.0663 ± 0.0757 nats over seeds (0 -0.2175, 1 +0.0052, 2 +0.0135), "
              "within noise (seed-to-seed spread 0.3616)")
    cut_short = "float8 Linear forward+backward on H200\nmeasured wq, wo: bfloat16 1.0 ms\nmeasured wk, wv: bfloat16 0.5 ms\n"
    assert figures.layer_bench_figure(tmp_path, cut_short) == (
        False, "no result table in the log; 2 'measured ...' line(s) in it from before it stopped")


def test_a_failing_stage_does_not_stop_the_next_and_lands_in_the_markdown(tmp_path):
    def figure(out: Path, log: str) -> tuple[bool, str]:
        return True, log.strip()

    failing = gpu_check.Stage("a", "fails", "fails", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 30,
                              figure)
    passing = gpu_check.Stage("b", "passes", "passes", [sys.executable, "-c", "print('fine')"], 30, figure)
    results = [gpu_check.run_stage(s, tmp_path, dict(os.environ)) for s in (failing, passing)]
    assert [(r.passed, r.exit_code, r.figure) for r in results] == [(False, 3, "exit 3; boom"), (True, 0, "fine")]
    assert (tmp_path / "a_fails.log").read_text() == "boom\n"
    info = dict(gpus="1", device="NVIDIA H100 80GB HBM3", driver="570.1", cuda="13.0", torch="2.11.0",
                torchao="0.18.0", commit="abc1234", date="2026-11-24 07:00 UTC")
    text = gpu_check.markdown_section(results, info, "scripts/gpu_check.sh", tmp_path)
    assert "## GPU acceptance run on 1 x NVIDIA H100 80GB HBM3 (2026-11-24 07:00 UTC)" in text
    assert "- device: 1 x NVIDIA H100 80GB HBM3, driver 570.1, CUDA 13.0" in text
    assert "- torch 2.11.0, torchao 0.18.0; commit abc1234; 2026-11-24 07:00 UTC" in text
    assert "| a. fails | **FAIL** | exit 3; boom |" in text and "| b. passes | pass | fine |" in text


def test_a_subset_of_stages_shares_the_budget_and_merges_with_earlier_results(tmp_path):
    stages = gpu_check.build_stages("python", tmp_path)
    assert [s.timeout_s for s in gpu_check.select_stages(stages, "abcdefg")] == [s.timeout_s for s in stages]
    assert [(s.key, s.timeout_s) for s in gpu_check.select_stages(stages, "b")] == [("b", gpu_check.BUDGET_S)]
    # The two-GPU stages keep their own limits; the one-GPU stages chosen with them still share the budget.
    assert [(s.key, s.timeout_s) for s in gpu_check.select_stages(stages, "bfg")] == [
        ("b", gpu_check.BUDGET_S), ("f", stages[5].timeout_s), ("g", stages[6].timeout_s)]

    def result(key: str, figure: str) -> gpu_check.StageResult:
        return gpu_check.StageResult(key, key, "cmd", True, figure, 1.0, 0, f"{key}.log")

    earlier = [result("a", "first a"), result("b", "first b")]
    (tmp_path / "summary.json").write_text(json.dumps({"stages": [vars(r) for r in earlier]}))
    merged = gpu_check.merge_results(tmp_path, [result("b", "second b"), result("c", "c")])
    assert [(r.key, r.figure) for r in merged] == [("a", "first a"), ("b", "second b"), ("c", "c")]


def test_stage_f_trains_llama3_debug_on_a_two_rank_pipeline():
    from config_registry import DEFAULT_REGISTRY as registry
    from torchtitan_lite.config import parse_cli
    from torchtitan_lite.resolved_run import resolve_run

    command = gpu_check.build_stages("python", Path("/out"))[5].command
    assert command[:3] == ["env", "NGPU=2", str(REPO / "run_train.sh")]
    cfg = parse_cli(command[3:], registry=registry).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=None)
    assert run.pipeline is not None and (run.pipeline.pp, run.pipeline.schedule) == (2, "1F1B")
    assert (cfg.training.steps, cfg.checkpoint.enable, cfg.job.dump_folder) == (20, False, "/out/f_run")


def test_stage_g_measures_every_schedule_on_two_gpus():
    from torchtitan_lite.tools import pipeline_bubble

    command = gpu_check.build_stages("python", Path("/out"))[6].command
    args, settings = pipeline_bubble.parse_args(command[2:])  # also resolves each schedule's layout
    assert (args.pp, args.schedules, settings.device) == ([2], list(pipeline_bubble.SCHEDULES), "cuda")
    assert (settings.flavor, settings.n_layers, settings.seq_len) == ("8B", 8, 1024)


def test_pipeline_stages_are_skipped_with_the_reason_on_one_gpu(tmp_path, monkeypatch, capsys):
    """On a one-GPU machine stages f and g do not run, say why, and leave the exit status to the others."""
    stages = gpu_check.build_stages("python", tmp_path)
    assert [s.key for s in stages if gpu_check.skip_reason(s, 2) is None] == list("abcdefg")
    assert [s.key for s in stages if gpu_check.skip_reason(s, 1) is None] == list("abcde")
    assert gpu_check.skip_reason(stages[5], 1) == (
        "skipped: needs 2 GPUs (one per pipeline rank), this machine has 1; run it on a machine with 2 or more")

    def figure(out: Path, log: str) -> tuple[bool, str]:
        return True, log.strip()

    fake = [gpu_check.Stage("a", "fine", "one GPU", [sys.executable, "-c", "print('ran')"], 30, figure),
            gpu_check.Stage("f", "pp", "two GPUs", [sys.executable, "-c", "raise SystemExit(3)"], 30, figure, gpus=2)]
    info = dict(gpus="1", device="NVIDIA H100 80GB HBM3", driver="570.1", cuda="13.0", torch="2.11.0",
                torchao="0.18.0", commit="abc1234", date="2026-11-24 07:00 UTC")
    monkeypatch.setattr(gpu_check, "build_stages", lambda python, out: fake)
    monkeypatch.setattr(gpu_check, "probe_interpreter", lambda python: ([], dict(info)))
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "af"]) == 0
    printed = capsys.readouterr().out
    assert ("[f] SKIPPED: needs 2 GPUs (one per pipeline rank), this machine has 1; run it on a machine with 2 or "
            "more") in printed
    assert "gpu_check: 1 of 1 stages passed; skipped (too few GPUs): f." in printed
    assert not (tmp_path / "f_pp.log").exists()
    summary = {s["key"]: s for s in json.loads((tmp_path / "summary.json").read_text())["stages"]}
    assert (summary["f"]["skipped"], summary["f"]["passed"], summary["a"]["skipped"]) == (True, True, False)
    assert "| f. two GPUs | skipped | skipped: needs 2 GPUs" in (tmp_path / "BENCHMARKS_section.md").read_text()


def test_figures_of_the_pipeline_stages(tmp_path):
    log = ("[rank0]:00:01:24 INFO torchtitan_lite: step      0  validation loss  15.2529\n"
           "[rank0]:00:01:25 INFO torchtitan_lite: step      1  loss  15.7380  grad_norm  2.2481  lr 1.200e-03\n"
           "[rank0]:00:01:30 INFO torchtitan_lite: step      4  loss   9.8918  grad_norm  6.8270  lr 3.000e-03\n")
    assert figures.pp_train_figure(tmp_path, log) == (True, "PP 2 x 1F1B: loss 15.7380 at step 1 -> 9.8918 at step 4")
    assert figures.pp_train_figure(tmp_path, log.replace("9.8918", "nan"))[0] is False
    assert figures.pp_train_figure(tmp_path, "") == (False, "no training loss in the log")

    assert figures.bubble_figure(tmp_path, "") == (False, "no bubble table (see g_pipeline_bubble.log)")
    (tmp_path / "g_pipeline_bubble.md").write_text(
        "Pipeline bubble, ...\n\n- GPUs: NVIDIA H100 80GB HBM3, one per rank (NCCL)\n\n"
        "| ranks | schedule | stages/rank | micro-batches | step ms | idle share per rank | mean | theory | "
        "chunk ms F / B / I / W | compute CPU share |\n|---:|---|\n"
        "| 2 | 1F1B | 1 | 8 | 310 | 12.0%, 11.0% | 11.5% | 11.1% | 10.0 / 20.0 / - / - | 1.00 |\n"
        "| 2 | ZBVZeroBubble | 2 | 8 | 290 | 3.0%, 4.0% | 3.5% | 0.0% | 5.0 / - / 5.0 / 5.0 | 1.00 |\n")
    assert figures.bubble_figure(tmp_path, "") == (
        True, "1F1B idle 11.5% (theory 11.1%), step 310 ms; ZBVZeroBubble idle 3.5% (theory 0.0%), step 290 ms")


def test_fetch_gpu_wheels_refuses_a_package_it_does_not_pin_before_writing_anything(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts" / "fetch_gpu_wheels.sh"), str(tmp_path / "w"), "torchao",
                             "numpy"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: numpy is not one of the packages this script pins: torchao datasets ")
    assert not (tmp_path / "w").exists()
