"""scripts/benchmark.py and its library (torchtitan_lite/tools/benchmark): the rate arithmetic and report on
fake measurements, the torchtitan side-by-side log parsing and generated config, and the benchmark CLI end to
end on 2 tiny steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_lite.tools.benchmark import report, runner
from torchtitan_lite.tools.benchmark.measurement import BareMeasurement, Measurement
from torchtitan_lite.tools.benchmark.run_info import RunInfo
from torchtitan_lite.tools.torchtitan_side_by_side import logs
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import Settings, torchtitan_config_source

REPO = Path(__file__).resolve().parents[2]


def _measurement(config: str, step_s: list[float], **kw) -> Measurement:
    fields = dict(
        config=config, device_type="cpu", device_name="fake cpu", dp_degree=1, tp_degree=1, tokens_per_step=1000,
        flops_per_token=1e9, peak_flops=1e13, compile_enabled=False, first_step_s=5.0, step_s=step_s,
        train_step_s=[s * 0.9 for s in step_s], peak_memory_gib=1.5,
    )
    fields.update(kw)
    return Measurement(**fields)


def test_rates_speedup_and_bare_ratio_from_fake_measurements():
    base = _measurement("fp32", [0.5, 0.5])  # 1000 tokens / 0.5 s = 2000 tokens/s
    fast = _measurement("fp8", [0.2, 0.3], dp_degree=2, tp_degree=2, compile_enabled=True, first_step_s=3.0,
                        peak_memory_gib=2.0, peak_reserved_gib=3.0)
    bare = {"fp32": BareMeasurement(config="fp32", tokens_per_s=2500.0, steps=2, elapsed_s=0.8,
                                          trainer_tokens_per_s=2000.0)}
    rows = report.build_rows([base, fast], "fp32", bare, {"fp8": "n/a (model converters (FP8))"})

    # Exact in binary floating point up to rounding of a few operations: 1e-9 relative.
    b, f = rows
    assert b.tokens_per_s_device == pytest.approx(2000.0, rel=1e-9)
    assert b.tflops_device == pytest.approx(2.0, rel=1e-9)          # 2000 tok/s x 1e9 FLOP/token
    assert b.mfu_percent == pytest.approx(20.0, rel=1e-9)           # 2 of 10 TFLOP/s
    assert b.step_ms == pytest.approx(500.0, rel=1e-9)
    assert b.step_cv_percent == pytest.approx(0.0, abs=1e-9)
    assert b.loop_overhead_percent == pytest.approx(10.0, rel=1e-9)  # train_step is 90% of the step
    assert b.compile_s is None and b.speedup == pytest.approx(1.0)
    assert b.trainer_over_bare == pytest.approx(0.8, rel=1e-9)      # interleaved trainer 2000 / bare 2500
    # mean step 0.25 s -> 4000 tok/s per rank; TP=2 shares tokens, DP=2 doubles the total.
    assert f.tokens_per_s_device == pytest.approx(2000.0, rel=1e-9)
    assert f.tokens_per_s_total == pytest.approx(8000.0, rel=1e-9)
    assert f.speedup == pytest.approx(4.0, rel=1e-9)
    assert f.step_cv_percent == pytest.approx(20.0, rel=1e-9)       # pstdev 0.05 / mean 0.25
    assert f.compile_s == pytest.approx(3.0 - 0.225, rel=1e-9)      # first step - median train_step
    assert f.memory == "2.00 / 3.00" and f.bare_tokens_per_s is None

    table = report.markdown_table(rows, "fp32").splitlines()
    assert table[0].startswith("| config | tokens/s/device | tokens/s total |")
    assert table[0].endswith("| speedup vs fp32 | bare loop tokens/s | trainer step / bare step |")
    assert table[2] == ("| `fp32` | 2,000 | 2,000 | 2 | 20.0% | 500.0 (0%) | 10.0% | - | 1.50 | 1.00x | 2,500 | 0.800 |")
    assert table[3] == ("| `fp8` | 2,000 | 8,000 | 2 | 20.0% | 250.0 (20%) | 10.0% | 2.8 | 2.00 / 3.00 | 4.00x "
                        "| n/a (model converters (FP8)) | - |")


def test_baseline_must_be_measured_and_steps_must_exist():
    with pytest.raises(ValueError, match=r"baseline 'bf16' was not measured; measured: fp32"):
        report.build_rows([_measurement("fp32", [1.0])], "bf16")
    with pytest.raises(ValueError, match=r"fp32: no timed steps were measured"):
        report.summarize(_measurement("fp32", []), baseline_tokens_per_s=1.0)


def test_markdown_section_append_and_chart(tmp_path):
    rows = report.build_rows([_measurement("fp32", [0.5])], "fp32")
    info = RunInfo(device="fake cpu", peak_note="a given CPU peak", torch_version="2.13.0",
                          torchao_version="0.18.0", commit="abc1234", date="2026-01-01 00:00 UTC",
                          command="python scripts/benchmark.py --configs fp32", warmup=1, steps=1)
    section = report.markdown_section(rows, info, baseline="fp32", title="T", memory_note="RSS")
    assert section.startswith("### T\n\n- device: fake cpu\n- torch 2.13.0, torchao 0.18.0, commit abc1234")
    assert "- command: `python scripts/benchmark.py --configs fp32`" in section
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n")
    report.write_markdown(out, section, append=True)
    report.write_markdown(out, section, append=True)
    assert out.read_text() == "# Benchmarks\n\n" + section + "\n" + section
    report.save_bar_chart(rows, tmp_path / "c.png", title="T", baseline="fp32")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_parses_both_logs_and_combines_intervals():
    torchtitan_log = ("[titan] INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.08  \x1b[34mtps: 194  tflops: 0.01\n"
                      "[titan] INFO - step: 10  loss:  7.1  memory: -0.00GiB(-0.00%)  tps: 3,000  tflops: 0.1\n"
                      "[titan] INFO - step: 20  loss:  6.9  tps: 1,000  tflops: 0.03\n")
    ours_log = ("[rank0] INFO torchtitan_lite: step      1  loss   8.14  tok/s 2,453 (global 2,453)\n"
                "[rank0] INFO torchtitan_lite: step     20  loss   6.50  tok/s 3,540 (global 3,540)\n")
    theirs = logs.parse_throughput(torchtitan_log, logs.TORCHTITAN_STEP)
    assert theirs == {1: 194.0, 10: 3000.0, 20: 1000.0}
    assert logs.parse_throughput(ours_log, logs.OURS_STEP) == {1: 2453.0, 20: 3540.0}
    # Equal-token intervals: 2 intervals / (1/3000 + 1/1000) s per token = 1500 tokens/s.
    assert logs.steady_tokens_per_s(theirs, warmup=1) == pytest.approx(1500.0, rel=1e-12)
    assert logs.steady_tokens_per_s(theirs, warmup=10) == pytest.approx(1000.0, rel=1e-12)
    with pytest.raises(ValueError, match=r"no throughput was logged after step 20; logged steps: \[1, 10, 20\]"):
        logs.steady_tokens_per_s(theirs, warmup=20)


def test_side_by_side_generated_config_carries_our_settings(tmp_path):
    settings = Settings(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_hidden_dim=768, norm_eps=1e-5,
        rope_theta=500000.0, max_seq_len=2048, seq_len=128, local_batch_size=8, lr=2e-3, betas=(0.9, 0.95),
        eps=1e-8, weight_decay=0.1, warmup_steps=20, decay_type="cosine", decay_ratio=None, min_lr_factor=0.1,
        max_norm=1.0, gc_freq=50, seed=0,
    )
    source = torchtitan_config_source(settings, tokenizer_dir=tmp_path / "tok", data_dir=tmp_path / "data")
    compile(source, "ttl_sbs_case.py", "exec")  # valid Python
    assert "DIM, N_LAYERS, N_HEADS, N_KV_HEADS = 256, 6, 8, 4" in source
    assert "VOCAB_SIZE, FFN_HIDDEN_DIM, NORM_EPS = 2048, 768, 1e-05" in source
    assert "default_adamw(lr=0.002, betas=(0.9, 0.95), eps=1e-08, weight_decay=0.1)" in source
    assert 'dtype="float32", mixed_precision_param=\'float32\'' in source
    assert "fuse_qkv=False" in source and "compile=CompileConfig(enable=False)" in source
    assert "activation_checkpoint=None" in source and "ScaledDotProductAttention.Config()" in source
    assert f"dataset_path={str(tmp_path / 'data')!r}" in source
    assert "Float8LinearConverter.Config(" not in source and "partial_dtensor" not in source


def test_benchmark_rejects_flags_it_owns():
    with pytest.raises(SystemExit):
        runner.parse_args(["--configs", "llama3_debug", "--training.steps", "5"])
    with pytest.raises(SystemExit):
        runner.parse_args(["--configs", "llama3_debug", "--baseline", "llama3_debug_bf16"])


def test_benchmark_cli_runs_two_tiny_steps_with_bare_loop(tmp_path):
    out_md, png = tmp_path / "BENCH.md", tmp_path / "bench.png"
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--configs", "llama3_debug", "--warmup", "1",
           "--steps", "2", "--bare-loop", "--cpu-peak-tflops", "0.1", "--out-md", str(out_md), "--png", str(png),
           "--json-out", str(tmp_path / "rows.json"), "--logs", str(tmp_path / "logs"), "--model.n_layers", "1",
           "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out_md.read_text()
    assert "| `llama3_debug` |" in text and "| 1.00x |" in text
    assert "MFU against a given CPU peak of 0.100 TFLOP/s" in text
    worker = json.loads((tmp_path / "logs" / "llama3_debug.0.trainer.json").read_text())
    assert worker["tokens_per_step"] == 64 and len(worker["step_s"]) == 2  # 2 x 32 tokens, 2 timed steps
    bare = json.loads((tmp_path / "logs" / "llama3_debug.0.bare.json").read_text())
    assert bare["steps"] == 2 and bare["tokens_per_s"] > 0 and bare["trainer_tokens_per_s"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["baseline"] == "llama3_debug" and rows["mfu_against"] == "a given CPU peak of 0.100 TFLOP/s"
    assert [r["config"] for r in rows["rows"]] == ["llama3_debug"] and rows["rows"][0]["speedup"] == 1.0
    assert rows["rows"][0]["peak_memory_gib"] > 0
