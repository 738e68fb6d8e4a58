"""scripts/gpu_check.sh: the plan without a GPU, the refusal without CUDA, and the figures read from each stage."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.tools import gpu_check, gpu_check_stages
from torchtitan_lite.tools import gpu_check_figures as figures
from torchtitan_lite.tools.benchmark import runner as benchmark

REPO = Path(__file__).resolve().parents[2]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, TTL_PYTHON=sys.executable), timeout=600)


def _stages(tmp: Path = Path("/out"), budget: int = gpu_check.BUDGET_S) -> dict[str, gpu_check.Stage]:
    shape = gpu_check.choose_run_shape(budget, gpu_check.STAGE_KEYS)
    return {s.key: s for s in gpu_check.build_stages("python", tmp, shape)}


def test_plan_gives_each_stage_its_expected_time_in_priority_order_and_cuts_what_the_budget_cannot_hold(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"")
    result = _script("--plan", "--out", str(tmp_path / "out"), "--wheels", str(tmp_path / "w"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stages = [line for line in lines if line.startswith("# stage ")]
    assert [s.split(":")[0] for s in stages] == [f"# stage {k}" for k in gpu_check.PRIORITY]
    expected = gpu_check_stages.EXPECTED_S
    # b, c and e fit the default 540 s (130 + 200 + 200); the rest is cut (the FP8 head's stage i too: as a
    # fourth config of c it would have pushed e out); f and g need two GPUs.
    assert f"(expected ~{expected['b']} s, done by ~130 s; blockwise not timed" in stages[0]
    assert "(expected ~200 s, done by ~330 s)" in stages[1] and "(expected ~200 s, done by ~530 s)" in stages[2]
    assert all("CUT: expected" in s for s in stages[3:7]) and all("needs 2 GPUs" in s for s in stages[7:])
    assert lines[0].endswith("--budget 540 s: the stages that fit expect 530 s together; cut for the budget: a, d, h, i")
    commands = [line for line in lines if not line.startswith("#")]
    assert commands[0].startswith(f"{sys.executable} -m pip install --no-index --no-deps")
    assert ("scripts/float8_layer_bench.py --shapes llama3_8b --recipes tensorwise rowwise rowwise_with_gw_hp "
            "--json-out") in commands[1]
    # A budget with room for blockwise's autotuning times it too (and runs the blockwise GPU tests).
    roomy = _script("--plan", "--budget", "1500", "--stages", "ab").stdout
    assert "rowwise_with_gw_hp blockwise --json-out" in roomy and "blockwise timed" in roomy
    assert "-k 'not blockwise'" not in roomy and "-k 'not blockwise'" in result.stdout


def test_the_representative_proxy_keeps_the_head_under_a_tenth_of_the_flops():
    from torchtitan_lite.tools.proxy_model import flops_split, layers_for_head_share

    block, head = flops_split("llama3", "8B", seq_len=8192)
    # 8B: head 6 x 4096 x 128256; block 6 x (attention 4096 x (4096 + 2 x 1024 + 4096) + MLP 3 x 4096 x 14336)
    # + 12 x 4096 x 8192 (attention scores and values).
    assert (head, block) == (6 * 4096 * 128256, 6 * (4096 * 10240 + 3 * 4096 * 14336) + 12 * 4096 * 8192)
    assert round(head / (head + 4 * block), 3) == 0.315  # the 4-block proxy: a third of the FLOPs in the head
    proxy = layers_for_head_share("llama3", "8B", seq_len=8192, max_share=0.10)
    assert proxy.n_layers == 17 and proxy.head_share <= 0.10 < head / (head + 16 * block)
    command = _stages()["c"].command
    args, overrides = benchmark.parse_args(command[2:])
    configs = benchmark._resolve(args.configs, overrides, DEFAULT_REGISTRY)
    assert (args.steps, args.profile_steps) == (30, 2)
    for cfg in configs.values():
        # No network on a GPU machine: the embedded corpus and byte tokens, not the hub corpus and tokenizer.
        assert (cfg.model.n_layers, cfg.training.seq_len, cfg.compile.enable, cfg.activation_checkpoint.mode,
                cfg.data.dataset, cfg.tokenizer.path) == (17, 8192, True, "selective", "embedded", None)


def test_stage_i_times_the_fp8_head_on_stage_c_proxy():
    stages = _stages()
    args, overrides = benchmark.parse_args(stages["i"].command[2:])
    c_args, c_overrides = benchmark.parse_args(stages["c"].command[2:])
    assert (args.configs, args.baseline, args.steps) == (["llama3_8b_fp8", "llama3_8b_fp8_head"], "llama3_8b_fp8", 30)
    assert overrides == c_overrides  # the same proxy: 17 blocks, seq 8192, AC, compile, embedded data
    configs = benchmark._resolve(args.configs, overrides, DEFAULT_REGISTRY)
    (base,), (head,) = (c.model_converters.converters for c in configs.values())
    # The two configs differ in the head only.
    assert (base.keep_output_hp, base.filter_fqns) == (True, ["output", "auto_filter_small_kn"])
    assert (head.keep_output_hp, head.filter_fqns) == (False, ["auto_filter_small_kn"])
    assert {k: v for k, v in vars(head).items() if k not in ("keep_output_hp", "filter_fqns")} == \
        {k: v for k, v in vars(base).items() if k not in ("keep_output_hp", "filter_fqns")}


def test_the_proxy_stages_share_one_activation_checkpointing_mode(monkeypatch):
    from torchtitan_lite.tools import proxy_model

    asked = []

    def fake_fit(mode):
        def fit(configs, overrides, *, device_bytes, registry):
            asked.append(configs)
            return mode, 90.0
        return fit

    shape = gpu_check.choose_run_shape(2000, "ci")
    planned = gpu_check.plan(gpu_check.build_stages("python", Path("/out"), shape), "ci", 2000)
    info = {"memory_bytes": str(141 * 1024**3)}
    monkeypatch.setattr(proxy_model, "fitting_ac_mode", fake_fit("full"))
    sized, note = gpu_check_stages.size_proxy(planned, shape, "python", Path("/out"), info)
    assert asked == [["llama3_8b", "llama3_8b_fp8", "llama3_8b_fp8_rowwise", "llama3_8b_fp8_head"]]
    for stage, _ in sized:
        assert stage.command[stage.command.index("--activation_checkpoint.mode") + 1] == "full", stage.key
    assert note == "stages c and i: estimated peak 90.0 GiB with AC full on this card's 141 GiB (--estimate-memory)"
    monkeypatch.setattr(proxy_model, "fitting_ac_mode", fake_fit(None))
    assert gpu_check_stages.size_proxy(planned, shape, "python", Path("/out"), info)[0] == []
    alone = gpu_check.plan(gpu_check.build_stages("python", Path("/out"), shape), "i", 2000)
    assert gpu_check_stages.size_proxy(alone, shape, "python", Path("/out"), info)[1].startswith(
        "stage i left out: its estimated peak with full activation checkpointing, 90.0 GiB")


def test_the_proxy_is_sized_to_the_card_by_the_memory_estimate():
    from torchtitan_lite.tools.proxy_model import fitting_ac_mode

    overrides = ["--model.n_layers", "17", "--training.seq_len", "8192", "--data.dataset", "embedded",
                 "--tokenizer.path", "none"]
    mode, peak = fitting_ac_mode(["llama3_8b"], overrides, device_bytes=141 * 1024**3, registry=DEFAULT_REGISTRY)
    assert mode == "selective" and 60 < peak < 0.9 * 141
    # fp32 master weights + AdamW alone are 16 bytes x 4.76e9 parameters = 71 GiB: no AC makes that fit in 40.
    assert fitting_ac_mode(["llama3_8b"], overrides, device_bytes=40 * 1024**3, registry=DEFAULT_REGISTRY)[0] is None


def test_stage_b_recipes_are_the_benchmarks_own():
    from torchtitan_lite.tools import float8_layer_bench

    args = float8_layer_bench.parse_args(_stages(budget=1500)["b"].command[2:])
    assert args.shapes == ["llama3_8b"] and args.recipes == ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"]
    float8_layer_bench.check_blockwise_shapes(float8_layer_bench.parse_shapes(args.shapes, args.tokens))  # 8B: whole blocks


def test_stage_e_benchmarks_compiled_moe_at_a_thousand_tokens_per_expert():
    command = _stages()["e"].command
    args, overrides = benchmark.parse_args(command[2:])
    configs = benchmark._resolve(args.configs, overrides, DEFAULT_REGISTRY)
    assert list(configs) == ["qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8", "qwen3_moe_30b_a3b_fp8_experts"]
    for cfg in configs.values():
        assert (cfg.model.name, cfg.model.flavor, cfg.model.n_layers) == ("qwen3_moe", "30B-A3B", 2)
        assert (cfg.training.seq_len, cfg.compile.enable, cfg.data.dataset, cfg.tokenizer.path) == (
            4096, True, "embedded", None)
        tokens = cfg.training.seq_len * cfg.training.local_batch_size
        assert tokens * 8 // 128 == 1024  # top-8 of 128 experts
    kinds = [c.kind for c in configs["qwen3_moe_30b_a3b_fp8_experts"].model_converters.converters]
    assert kinds == ["moe_experts"]
    assert (args.profile_steps, args.profile_dir) == (2, Path("/out/e_profiles"))  # where the experts' time goes


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
    assert figure.endswith("target llama3_8b_fp8 >= 1.25x: MISSED, target llama3_8b_fp8_rowwise >= 1.08x: met, "
                           "target BF16 MFU >= 40%: met")

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
    # The bench's JSON (rewritten after each shape) wins over the log, and says when a recipe is partial.
    layers = {"rows": [{"name": "wq, wo", "m": 8192, "k": 4096, "n": 4096, "count": 2,
                        "seconds": {"hp": 0.004, "tensorwise": 0.002, "rowwise": 0.004}},
                       {"name": "w2", "m": 8192, "k": 14336, "n": 4096, "count": 1, "seconds": {"hp": 0.012,
                                                                                                 "tensorwise": 0.01}}]}
    (tmp_path / "b_layers.json").write_text(json.dumps(layers))
    assert figures.layer_bench_figure(tmp_path, "") == (
        True, "sum of the 8B Linears (2 shapes), FP8 over BF16: tensorwise 1.43x, rowwise 1.00x (1 shapes)")
    table = gpu_check.layer_table(layers)
    assert "| wq, wo | 8192 | 4096 | 4096 | 2 | 4.000 | 2.000 (2.00x) | 4.000 (1.00x) |" in table
    assert "| w2 | 8192 | 14336 | 4096 | 1 | 12.000 | 10.000 (1.20x) | - |" in table
    (tmp_path / "b_layers.json").unlink()
    cut_short = "float8 Linear forward+backward on H200\nmeasured wq, wo: bfloat16 1.0 ms\nmeasured wk, wv: bfloat16 0.5 ms\n"
    assert figures.layer_bench_figure(tmp_path, cut_short) == (
        False, "no result table in the log; 2 'measured ...' line(s) in it from before it stopped")


def test_the_head_figure_is_the_step_ratio_without_stage_c_targets(tmp_path):
    assert figures.head_figure(tmp_path, "") == (False, "no benchmark rows (see i_fp8_head.log)")
    row = dict(tokens_per_s_device=20000.0, tflops_device=650.0, mfu_percent=65.5, peak_memory_gib=72.3, compile_s=18.0)
    (tmp_path / "i_benchmark.json").write_text(json.dumps({"rows": [dict(row, config="llama3_8b_fp8", speedup=1.0)]}))
    assert figures.head_figure(tmp_path, "") == (False, "no row for llama3_8b_fp8_head in i_benchmark.json")
    (tmp_path / "i_benchmark.json").write_text(json.dumps({"rows": [
        dict(row, config="llama3_8b_fp8", speedup=1.0),
        dict(row, config="llama3_8b_fp8_head", speedup=1.034, tokens_per_s_device=20680.0)]}))
    ok, figure = figures.head_figure(tmp_path, "")
    assert ok and figure == (
        "llama3_8b_fp8: 20,000 tok/s, 650 TFLOP/s, MFU 65.5%, 72.3 GiB, compile 18 s, 1.00x; "
        "llama3_8b_fp8_head: 20,680 tok/s, 650 TFLOP/s, MFU 65.5%, 72.3 GiB, compile 18 s, 1.03x; "
        "the FP8 head makes the step 1.034x as fast as the BF16 head")
    assert "target" not in figure  # llama3_8b_fp8 is the baseline here, not a config judged against BF16


INFO = dict(gpus="1", device="NVIDIA H100 80GB HBM3", driver="570.1", cuda="13.0", torch="2.11.0", torchao="0.18.0",
            commit="abc1234", date="2026-11-24 07:00 UTC")


def _echo(out: Path, log: str) -> tuple[bool, str]:
    return True, log.strip()


def test_a_failing_stage_does_not_stop_the_next_and_lands_in_the_markdown(tmp_path):
    failing = gpu_check.Stage("a", "fails", "fails", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 30,
                              _echo)
    passing = gpu_check.Stage("b", "passes", "passes", [sys.executable, "-c", "print('fine')"], 30, _echo)
    results = [gpu_check.run_stage(s, tmp_path, dict(os.environ), 30) for s in (failing, passing)]
    assert [(r.passed, r.exit_code, r.figure) for r in results] == [(False, 3, "exit 3; boom"), (True, 0, "fine")]
    assert (tmp_path / "a_fails.log").read_text() == "boom\n"
    text = gpu_check.markdown_section(results, INFO, "scripts/gpu_check.sh", tmp_path)
    assert "## GPU acceptance run on 1 x NVIDIA H100 80GB HBM3 (2026-11-24 07:00 UTC)" in text
    assert "- device: 1 x NVIDIA H100 80GB HBM3 (? GiB), driver 570.1, CUDA 13.0" in text
    assert "- torch 2.11.0, torchao 0.18.0; commit abc1234; 2026-11-24 07:00 UTC" in text
    assert "| a. fails | **FAIL** | exit 3; boom |" in text and "| b. passes | pass | fine |" in text


def test_the_budget_cuts_stages_that_do_not_fit_and_a_stage_stopped_mid_way_keeps_what_it_wrote(tmp_path, monkeypatch,
                                                                                                capsys):
    """b finishes; c writes a figure, then outlives the budget and is stopped; e no longer fits and is cut.
    Each stage's figure is in the report as soon as it ends."""
    c_writes = ("import pathlib, time; pathlib.Path('%s').write_text('half'); print('started', flush=True); "
                "time.sleep(60)" % (tmp_path / "c_part.txt"))

    def c_figure(out: Path, log: str) -> tuple[bool, str]:
        return True, f"{log.strip()}, file says {(out / 'c_part.txt').read_text()}"

    def after_b(out: Path, log: str) -> tuple[bool, str]:
        report = (out / "BENCHMARKS_section.md").read_text() if (out / "BENCHMARKS_section.md").exists() else ""
        return True, f"{log.strip()} (report before: {'b.' in report})"

    fake = [gpu_check.Stage("b", "quick", "quick", [sys.executable, "-c", "print('done')"], 5, after_b),
            gpu_check.Stage("c", "slow", "slow", [sys.executable, "-c", c_writes], 60, c_figure),
            gpu_check.Stage("e", "next", "next", [sys.executable, "-c", "print('never')"], 30, _echo)]
    monkeypatch.setattr(gpu_check, "build_stages", lambda python, out, shape: fake)
    monkeypatch.setattr(gpu_check, "probe_interpreter", lambda python: ([], dict(INFO)))
    monkeypatch.setattr(gpu_check, "LIMIT_FACTOR", 1.0)
    started = time.perf_counter()
    # A 61 s budget: b (5 s expected) and c (60 s) fit when planned; c runs out of budget after ~56 s...
    # too slow for a unit test, so c's expected time is what fits and its limit is what stops it.
    fake[1] = dataclasses.replace(fake[1], expected_s=3)
    fake[2] = dataclasses.replace(fake[2], expected_s=200)
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "bce", "--budget", "60"]) == 1
    assert time.perf_counter() - started < 30
    printed = capsys.readouterr().out
    summary = {s["key"]: s for s in json.loads((tmp_path / "summary.json").read_text())["stages"]}
    assert (summary["b"]["passed"], summary["b"]["figure"]) == (True, "done (report before: False)")
    assert summary["c"]["passed"] is False and summary["c"]["exit_code"] is None
    assert summary["c"]["figure"].startswith("cut mid-way after 3 s: its 3 s ran out; what it wrote: started, "
                                             "file says half")
    assert summary["e"]["skipped"] is True and summary["e"]["figure"].startswith(
        "cut: not started, it needs ~200 s and ")
    assert "[e] CUT: not started" in printed and not (tmp_path / "e_next.log").exists()
    report = (tmp_path / "BENCHMARKS_section.md").read_text()
    assert "| c. slow | **FAIL** | cut mid-way after 3 s" in report and "| e. next | cut | cut: not started" in report


def test_sigterm_stops_the_running_stage_and_writes_the_report(tmp_path):
    """The device command's own time limit sends SIGTERM: the stage's process group goes, the report stays."""
    script = tmp_path / "run.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from torchtitan_lite.tools import gpu_check
info = dict(gpus="1", device="GPU", driver="1", cuda="13.0", torch="2.11.0", torchao="0.18.0", commit="c", date="d")
def echo(out, log):
    return True, log.strip()
gpu_check.probe_interpreter = lambda python: ([], dict(info))
gpu_check.build_stages = lambda python, out, shape: [
    gpu_check.Stage("b", "first", "first", [sys.executable, "-c", "print('b ok')"], 5, echo),
    gpu_check.Stage("c", "hangs", "hangs", [sys.executable, "-c", "import time; print('c up', flush=True); time.sleep(120)"],
                    100, echo)]
sys.exit(gpu_check.main(["--out", {str(tmp_path / 'out')!r}, "--stages", "bc", "--budget", "300"]))
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    log = tmp_path / "out" / "c_hangs.log"
    deadline = time.time() + 60
    while not (log.exists() and "c up" in log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1
    summary = {s["key"]: s for s in json.loads((tmp_path / "out" / "summary.json").read_text())["stages"]}
    assert summary["b"]["figure"] == "b ok"
    assert summary["c"]["figure"].startswith("cut mid-way after ") and "the run was stopped (SIGTERM)" in summary["c"]["figure"]
    assert "the run was stopped from outside (SIGTERM)" in (tmp_path / "out" / "BENCHMARKS_section.md").read_text()


def test_merges_with_earlier_results_in_the_same_folder(tmp_path):
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

    command = _stages()["f"].command
    assert command[:3] == ["env", "NGPU=2", str(REPO / "run_train.sh")]
    cfg = parse_cli(command[3:], registry=registry).config
    run = resolve_run(cfg, world_size=2, device_type="cpu", vocab_size=None)
    assert run.pipeline is not None and (run.pipeline.pp, run.pipeline.schedule) == (2, "1F1B")
    assert (cfg.training.steps, cfg.checkpoint.enable, cfg.job.dump_folder) == (20, False, "/out/f_run")


def test_stage_g_measures_every_schedule_on_two_gpus():
    from torchtitan_lite.tools import pipeline_bubble

    command = _stages()["g"].command
    args, settings = pipeline_bubble.parse_args(command[2:])  # also resolves each schedule's layout
    assert (args.pp, args.schedules, settings.device) == ([2], list(pipeline_bubble.SCHEDULES), "cuda")
    assert (settings.flavor, settings.n_layers, settings.seq_len) == ("8B", 8, 1024)


def test_pipeline_stages_are_skipped_with_the_reason_on_one_gpu(tmp_path, monkeypatch, capsys):
    """On a one-GPU machine stages f and g do not run, say why, and leave the exit status to the others."""
    stages = list(_stages(tmp_path).values())
    assert [s.key for s in stages if gpu_check.skip_reason(s, 2) is None] == list(gpu_check.PRIORITY)
    assert [s.key for s in stages if gpu_check.skip_reason(s, 1) is None] == list("bceadhi")
    assert gpu_check.skip_reason(_stages(tmp_path)["f"], 1) == (
        "skipped: needs 2 GPUs (one per pipeline rank), this machine has 1; run it on a machine with 2 or more")

    fake = [gpu_check.Stage("a", "fine", "one GPU", [sys.executable, "-c", "print('ran')"], 30, _echo),
            gpu_check.Stage("f", "pp", "two GPUs", [sys.executable, "-c", "raise SystemExit(3)"], 30, _echo, gpus=2)]
    monkeypatch.setattr(gpu_check, "build_stages", lambda python, out, shape: fake)
    monkeypatch.setattr(gpu_check, "probe_interpreter", lambda python: ([], dict(INFO)))
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "af"]) == 0
    printed = capsys.readouterr().out
    assert ("[f] SKIPPED: needs 2 GPUs (one per pipeline rank), this machine has 1; run it on a machine with 2 or "
            "more") in printed
    assert "gpu_check: 1 of 1 stages passed; not run (cut by the budget or too few GPUs): f." in printed
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


def test_the_moe_stage_writes_both_configs_profiles_by_category(tmp_path):
    row = dict(tokens_per_s_device=1000.0, tflops_device=300.0, mfu_percent=30.0, peak_memory_gib=38.0, compile_s=20.0)
    (tmp_path / "e_benchmark.json").write_text(json.dumps({"rows": [
        dict(row, config="qwen3_moe_30b_a3b", speedup=1.0), dict(row, config="qwen3_moe_30b_a3b_fp8", speedup=0.84)]}))
    (tmp_path / "e_profiles").mkdir()
    grouped = {"name": "k", "op": "aten::_grouped_mm", "chain": [], "shapes": [], "us": 20_000.0, "count": 1}
    scaled = dict(grouped, op="aten::_scaled_grouped_mm", us=16_000.0)
    casts = dict(grouped, name="triton_red_fused_abs_amax_3", op="CompiledFunction", us=12_000.0)
    for name, records in (("qwen3_moe_30b_a3b", [grouped]), ("qwen3_moe_30b_a3b_fp8", [scaled, casts])):
        (tmp_path / "e_profiles" / f"{name}.json").write_text(json.dumps(
            {"steps": 2, "vocab_size": 151936, "converted": [], "records": records}))
    ok, figure = gpu_check_stages.moe_figure(tmp_path, "")
    assert ok and "qwen3_moe_30b_a3b_fp8: 1,000 tok/s" in figure
    table = (tmp_path / "e_profiles.md").read_text()
    assert "| BF16 GEMMs (blocks) | 10.00 | 0.00 |" in table and "| FP8 GEMMs | 0.00 | 8.00 |" in table
    assert "| casts and amax | 0.00 | 6.00 |" in table
