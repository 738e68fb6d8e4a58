"""Live FP8 health: per-cast saturation / underflow as torchao casts, per-layer stats, warnings, compile."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

from torchtitan_lite.components.metrics import MetricsProcessor
from torchtitan_lite.components.quantization.cast_health import (
    float8_casts,
    measure_cast,
    mx_casts,
    saturation_threshold,
)
from torchtitan_lite.components.quantization.fp8_stats import Fp8StatsCollector
from torchtitan_lite.components.quantization.fp8_stats_report import summary_line, threshold_crossings


def _wide_range(rows: int = 256, cols: int = 128) -> torch.Tensor:
    """Columns spanning 8 decades of magnitude: many elements near the bottom of e4m3's range."""
    torch.manual_seed(0)
    return (torch.randn(rows, cols) * torch.logspace(-6, 2, cols)).bfloat16()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_measured_underflow_is_exactly_what_torchaos_cast_flushes(recipe):
    config = Float8LinearConfig.from_recipe_name(recipe)
    x = _wide_range()
    for cast in [c for c in float8_casts(config) if c.operand == "input"]:
        cast_config = config.cast_config_input if cast.name == "input" else config.cast_config_input_for_grad_weight
        fp8 = hp_tensor_to_float8_dynamic(
            x, cast_config.target_dtype, LinearMMConfig(), gemm_input_role=GemmInputRole.INPUT,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(cast.dim, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        flushed = int(((x != 0) & (fp8._data.float() == 0)).sum())
        elements, saturated, underflowed = measure_cast(cast, x).tolist()
        assert (elements, underflowed) == (x.numel(), flushed), cast
        assert saturated == 0  # amax scaling puts the largest element on the max, never beyond
        # Scales along rows span the 8 decades; a scale per column (each of one magnitude) loses nothing.
        assert (flushed > 1000) if cast.dim == -1 else (flushed == 0)


def test_casts_per_recipe_and_format_limits():
    def names(recipe):
        return [(c.name, c.describe()) for c in float8_casts(Float8LinearConfig.from_recipe_name(recipe))]

    # Tensorwise casts are the same for every GEMM; rowwise scales each GEMM's reduction dim.
    assert names("tensorwise") == [("input", "e4m3 tensorwise"), ("weight", "e4m3 tensorwise"),
                                   ("grad_output", "e5m2 tensorwise")]
    assert [n for n, _ in names("rowwise")] == ["input", "weight", "grad_output", "input_gw", "weight_gi",
                                                "grad_output_gw"]
    assert names("rowwise")[3] == ("input_gw", "e4m3 per column, power-of-2 scales")
    assert names("rowwise_with_gw_hp")[3:] == [("weight_gi", "e4m3 tensorwise")]  # the gw GEMM is high precision
    # The smallest magnitude that rounding alone would not bring back to the max: max + ulp(max) / 2.
    assert saturation_threshold(torch.float8_e4m3fn) == 448 + 16
    assert saturation_threshold(torch.float8_e5m2) == 57344 + 4096


def _two_layer_fp8(recipe: str = "tensorwise") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def _stats_step(model: nn.Module, x: torch.Tensor, collector: Fp8StatsCollector):
    with collector.capture():
        model(x).square().mean().backward()
    model.zero_grad()
    return {h.fqn: h for h in collector.collect()}


def _output_grad_amax(model: nn.Module, x: torch.Tensor) -> float:
    """max |d loss / d output| of the first Linear, read by a tensor hook of our own (same step, same weights)."""
    grads: list[torch.Tensor] = []

    def keep_output_grad(module, args, output) -> None:
        output.register_hook(grads.append)

    handle = model[0].register_forward_hook(keep_output_grad)
    model(x).square().mean().backward()
    handle.remove()
    model.zero_grad()
    return float(grads[0].abs().max())


def test_layer_stats_are_the_direct_measurement_of_that_micro_batch():
    model = _two_layer_fp8()
    collector = Fp8StatsCollector([model], freq=5)
    assert [collector.due(s) for s in (4, 5, 10)] == [False, True, True]
    x = torch.randn(32, 64)
    health = _stats_step(model, x, collector)
    first = health["0"]
    cast = float8_casts(model[0].config)[0]
    assert first.amax == {"input": pytest.approx(float(x.abs().max())),
                          "weight": pytest.approx(float(model[0].weight.detach().abs().max())),
                          "grad_output": pytest.approx(_output_grad_amax(model, x))}
    elements, _, underflowed = measure_cast(cast, x).tolist()
    assert first.underflow["input"] == underflowed / elements
    with torch.no_grad():
        reference = x @ model[0].weight.t()
        fp8 = model[0](x)
    direct = 10 * math.log10(float(reference.square().sum()) / float((reference - fp8).square().sum()))
    # Same operands, same FP8 forward: the SQNR agrees to float rounding of the energy sums.
    assert first.output_sqnr_db == pytest.approx(direct, abs=1e-6)
    assert 25 < first.output_sqnr_db < 35  # e4m3 (3 mantissa bits) on a Gaussian input: ~28.5 dB
    assert set(first.scalars()) == {f"fp8/0/{k}" for k in (
        "input_amax", "weight_amax", "grad_output_amax", "input_saturated", "weight_saturated",
        "grad_output_saturated", "input_underflow", "weight_underflow", "grad_output_underflow", "output_sqnr_db")}
    # Nothing stays installed after the stats micro-batch, and the next collect starts from zero.
    assert not model[0]._forward_hooks and collector.collect()[0].amax == {}


def test_a_planted_outlier_shows_as_underflow_and_a_warning_naming_the_layer(caplog):
    model = _two_layer_fp8()
    collector = Fp8StatsCollector([model], freq=1)
    x = torch.randn(32, 64)
    clean = _stats_step(model, x, collector)
    assert clean["0"].underflow["input"] < 1e-3 and clean["0"].saturated["input"] == 0
    assert threshold_crossings(1, list(clean.values()), saturation=1e-4, underflow=1e-3) == []

    x[3, 7] = 1e6  # one activation outlier: the tensorwise scale shrinks ~1e6x, the rest falls below e4m3
    planted = _stats_step(model, x, collector)
    assert planted["0"].underflow["input"] > 0.9 and planted["0"].amax["input"] == 1e6
    # The output SQNR hides it: energy-weighted, it is dominated by the outlier's own row. The underflow
    # share is what shows that 9 in 10 elements became 0.
    assert planted["0"].output_sqnr_db > 25
    # The second Linear's input is the first one's output: its underflow share depends on how this CPU's
    # matmul rounds (15.3% on one machine, 15.7% on another). Fixed here, so the text below is exact.
    assert planted["2"].underflow["input"] > 0.01
    planted["2"].underflow["input"] = 0.125
    metrics = MetricsProcessor.Config(enable_tensorboard=False, cpu_peak_tflops=1.0).build(
        dump_folder="unused", device="cpu", num_flops_per_token=1.0, rank=0)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        metrics.log_fp8_stats(7, list(planted.values()))
    assert "fp8 stats step 7: 0 input cast (e4m3 tensorwise) flushes to zero 9" in caplog.text
    assert "of its elements (nonzero but below the smallest subnormal after scaling; threshold 1%), amax 1e+06" \
        in caplog.text
    assert "fp8 stats step 7 (2 Linears); lowest output SQNR " in caplog.text
    assert "; underflow 0 input 9.6" in caplog.text  # the worst share leads the console summary

    # The same crossing again is on the summary, not warned again; warned anew once its share has doubled.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        metrics.log_fp8_stats(8, list(planted.values()))
        assert caplog.text == ""
        planted["2"].underflow["input"] *= 2
        metrics.log_fp8_stats(9, list(planted.values()))
    assert "fp8 stats step 9: 2 input cast" in caplog.text and "; up from 12.5% when last reported" in caplog.text
    assert "fp8 stats step 9: 0 input" not in caplog.text


def test_mx_floor_scales_saturate_planted_outliers_and_rceil_does_not():
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def mx_model(mode):
        torch.manual_seed(0)
        return nn.Sequential(MXFP8Linear(64, 64, bias=False, kernel_preference=KernelPreference.EMULATED,
                                         scale_calculation_mode=mode)).bfloat16()

    x = torch.randn(64, 64).bfloat16()
    x[:, ::32] = 1.9 * 64  # every 32-block's max has mantissa 1.9 > 1.75: floor puts it at 486 > e4m3's 448
    floor_model = mx_model(ScaleCalculationMode.FLOOR)
    floor = _stats_step(floor_model, x, Fp8StatsCollector([floor_model], freq=1))["0"]
    assert [c.name for c in mx_casts(floor_model[0])] == ["input", "weight", "grad_output", "weight_gi",
                                                          "grad_output_gw", "input_gw"]
    assert floor.casts["input"] == "e4m3 MX blocks of 32 along rows (floor)"
    assert floor.saturated["input"] == 1 / 32  # exactly the planted element of every block
    crossings = threshold_crossings(3, [floor], saturation=1e-4, underflow=1e-3)
    assert crossings[0].key == ("0", "input", "saturated") and crossings[0].share == 1 / 32
    assert crossings[0].message.startswith("fp8 stats step 3: 0 input cast (e4m3 MX blocks of 32 along rows (floor)) "
                                  "saturates 3.12% of its elements (clamped at the format's max")
    rceil_model = mx_model(ScaleCalculationMode.RCEIL)
    rceil = _stats_step(rceil_model, x, Fp8StatsCollector([rceil_model], freq=1))["0"]
    assert rceil.saturated["input"] == 0 and 25 < rceil.output_sqnr_db < 40


def test_summary_names_the_worst_layers_only():
    model = _two_layer_fp8()
    health = _stats_step(model, torch.randn(32, 64), Fp8StatsCollector([model], freq=1))
    line = summary_line(4, list(health.values()), worst=1)
    assert line.startswith("fp8 stats step 4 (2 Linears); lowest output SQNR ")
    assert line.count(" dB") == 1 and line.endswith("saturated none")


def test_compiled_modules_run_eagerly_on_the_stats_step_and_never_recompile():
    torch._dynamo.reset()
    model = _two_layer_fp8()
    model.compile(backend="aot_eager", fullgraph=True)
    collector = Fp8StatsCollector([model], freq=2)
    x = torch.randn(32, 64)

    def step():
        model(x).square().mean().backward()
        model.zero_grad()

    step()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    health = _stats_step(model, x, collector)
    step()
    step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile, no new graph
    assert health["2"].output_sqnr_db is not None and "grad_output" in health["2"].amax
    assert model._compiled_call_impl is not None  # the compiled forward is back


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="metrics.fp8_stats_freq must be >= 0"):
        MetricsProcessor.Config(fp8_stats_freq=-1)
    with pytest.raises(ValueError, match="metrics.fp8_underflow_warn is a share of elements between 0 and 1"):
        MetricsProcessor.Config(fp8_underflow_warn=2.0)
    with pytest.raises(ValueError, match="the model has no FP8 / MX Linear to measure"):
        Fp8StatsCollector([nn.Linear(16, 16)], freq=10)


def test_stats_without_a_converter_are_refused_before_the_run():
    import config_registry
    from torchtitan_lite.resolved_run import resolve_run

    cfg = config_registry.get("llama3_debug")
    cfg.metrics.fp8_stats_freq = 10
    with pytest.raises(ValueError, match="metrics.fp8_stats_freq=10 measures FP8 / MX Linears, but "
                                         "model_converters.converters is empty"):
        resolve_run(cfg, world_size=1, device_type="cpu")


def test_chunked_measurement_counts_exactly_what_one_pass_counts(monkeypatch):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    from torchtitan_lite.components.quantization import cast_health

    x = _wide_range(rows=256, cols=128)
    casts = (float8_casts(Float8LinearConfig.from_recipe_name("tensorwise"))
             + float8_casts(Float8LinearConfig.from_recipe_name("rowwise"))
             + mx_casts(MXFP8Linear(128, 64, scale_calculation_mode=ScaleCalculationMode.FLOOR)))
    whole = [measure_cast(cast, x) for cast in casts]
    model = _two_layer_fp8()
    batch = torch.randn(48, 64)
    sqnr = _stats_step(model, batch, Fp8StatsCollector([model], freq=1))["2"].output_sqnr_db
    # 1000 elements per chunk: 7 row chunks of x (MX column blocks: chunks of 32 rows), and 16 rows of the
    # 64-wide layer output per SQNR chunk; the scales (whole-tensor and per-column amax) span all chunks.
    monkeypatch.setattr(cast_health, "CHUNK_ELEMENTS", 1000)
    assert [measure_cast(cast, x).tolist() for cast in casts] == [counts.tolist() for counts in whole]
    chunked = _stats_step(model, batch, Fp8StatsCollector([model], freq=1))["2"].output_sqnr_db
    # The reference GEMM on 16 rows at a time may round differently in float32 than on all 48: ~1e-9 relative.
    assert chunked == pytest.approx(sqnr, rel=1e-6)
