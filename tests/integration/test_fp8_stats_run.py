"""A llama3_debug_fp8 run with FP8 stats on: TensorBoard holds fp8/ scalars for every converted Linear, and
validation runs in the high-precision policy when asked."""
from __future__ import annotations

from _cli import TINY, read_scalars

STATS = ("input_amax", "weight_amax", "grad_output_amax", "input_saturated", "weight_saturated",
         "grad_output_saturated", "input_underflow", "weight_underflow", "grad_output_underflow", "output_sqnr_db")


def test_fp8_stats_reach_tensorboard_for_every_converted_linear(cli, tmp_path):
    result = cli(["--config", "llama3_debug_fp8", *TINY, "--training.steps", "10", "--metrics.fp8_stats_freq", "10",
                  "--checkpoint.enable", "false", "--metrics.cpu_peak_tflops", "1", "--validation.enable", "true",
                  "--validation.freq", "10", "--validation.steps", "1", "--validation.low_precision", "false",
                  "--job.dump_folder", str(tmp_path)], launcher="train.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "fp8 stats step 10 (14 Linears); lowest output SQNR " in log
    # The launch log summarises the FP8 plan; the table of every Linear is --print-fp8-plan's.
    assert ("float8 converter (tensorwise): FP8 plan: 14 of 15 Linear layers run in FP8 (14 tensorwise); high "
            "precision: 1 filter_fqns entry 'output'\n") in log
    assert "every Linear with its recipe or skip reason: --print-fp8-plan" in log
    assert "skipped because" not in log and log.count("FP8 plan:") == 1

    scalars = read_scalars(tmp_path / "tb")
    # llama3_debug_fp8 converts every block Linear (the output head is filtered): 7 per block, 2 blocks.
    converted = {f"layers.{b}.{name}" for b in range(2) for name in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3")}
    fp8_tags = {tag for tag in scalars if tag.startswith("fp8/")}
    assert fp8_tags == {f"fp8/{fqn}/{stat}" for fqn in converted for stat in STATS}
    for tag in fp8_tags:
        assert set(scalars[tag]) == {10}, tag  # only the stats step
    for fqn in converted:
        # e4m3 forward on the debug model: ~29 dB for most Linears (docs/mixed_precision.md), up to 40.5 dB for
        # w2 and wo, whose outputs sum over wider or smoother inputs and average the cast errors (measured at step
        # 10 of this run); an unquantized GEMM matches its reference (infinite SQNR). Nothing saturates.
        assert 20 < scalars[f"fp8/{fqn}/output_sqnr_db"][10] < 50
        assert scalars[f"fp8/{fqn}/input_saturated"][10] == 0
    assert set(scalars["val/loss"]) == {0, 10}
