"""Live FP8 health of blockwise FP8 Linears: each tile kind's underflow / saturation is exactly what the
emulated GEMMs' casts do, planted outliers land in the tile kind they should, and a training run logs them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from torchtitan_lite.components.quantization import cast_health
from torchtitan_lite.components.quantization.blockwise_fp8 import fake_1x128, fake_128x128, quantize_128x128
from torchtitan_lite.components.quantization.blockwise_linear import BlockwiseFP8Linear
from torchtitan_lite.components.quantization.cast_health import blockwise_casts, measure_cast
from torchtitan_lite.components.quantization.fp8_stats import Fp8StatsCollector


def _blockwise(in_features: int, out_features: int, *, power_of_2: bool, seed: int = 0) -> BlockwiseFP8Linear:
    torch.manual_seed(seed)
    linear = BlockwiseFP8Linear(in_features, out_features, bias=False)
    linear.power_of_2 = power_of_2
    return linear


def test_a_blockwise_linear_has_five_casts_one_per_tile_kind():
    casts = blockwise_casts(_blockwise(256, 128, power_of_2=True))
    assert [(c.name, c.operand, c.describe()) for c in casts] == [
        ("input", "input", "e4m3 1x128 tiles along rows, power-of-2 scales"),
        ("weight", "weight", "e4m3 128x128 blocks, power-of-2 scales"),          # forward and input gradient
        ("grad_output", "grad_output", "e4m3 1x128 tiles along rows, power-of-2 scales"),
        ("grad_output_gw", "grad_output", "e4m3 1x128 tiles along columns, power-of-2 scales"),   # along tokens
        ("input_gw", "input", "e4m3 1x128 tiles along columns, power-of-2 scales")]
    assert blockwise_casts(_blockwise(256, 128, power_of_2=False))[1].describe() == "e4m3 128x128 blocks"


def _flushed_by_the_gemm(cast: cast_health.Cast, x: torch.Tensor) -> int:
    """Nonzero elements of ``x`` that the emulated GEMM's own quantization (blockwise_fp8.fake_*) makes 0."""
    if cast.granularity == "block":
        fake = fake_128x128(x, power_of_2=cast.power_of_2)
    elif cast.dim == -1:
        fake = fake_1x128(x, power_of_2=cast.power_of_2)
    else:
        fake = fake_1x128(x.t(), power_of_2=cast.power_of_2).t()
    return int(((x != 0) & (fake == 0)).sum())


@pytest.mark.parametrize("power_of_2", [False, True])
def test_measured_underflow_is_exactly_what_the_emulated_gemms_flush(power_of_2, monkeypatch):
    torch.manual_seed(0)
    # 8 decades of magnitude across the columns and, less, down the rows: every tile kind flushes some elements.
    # 300 rows: the tiles down a column end in a short one (44 tokens), padded as the weight-gradient GEMM pads.
    x = (torch.randn(300, 256) * torch.logspace(-6, 2, 256) * torch.logspace(0, 2, 300)[:, None]).bfloat16()
    w = x[:256]   # the block cast needs both dims multiples of 128
    casts = blockwise_casts(_blockwise(256, 256, power_of_2=power_of_2))
    operands = {"input": x, "grad_output": x, "weight": w}
    counts = {}
    for cast in casts:
        operand = operands[cast.operand]
        elements, saturated, underflowed = measure_cast(cast, operand).tolist()
        assert (elements, underflowed) == (operand.numel(), _flushed_by_the_gemm(cast, operand)), cast
        assert saturated == 0   # the tile amax lands on 448 (or below it, power-of-2 scales), never beyond
        counts[cast.name] = underflowed
    # The scales along rows span the 8 decades: many elements flushed; down a column only 2 decades: none.
    # Tiles along rows span 4 of the 8 decades, weight blocks all 8: elements below amax * 2.2e-6 flush (more with
    # power-of-2 scales, rounded down). Down a column the magnitudes span 2 decades: nothing flushes.
    assert 100 < counts["input"] == counts["grad_output"] < counts["weight"]
    assert counts["input_gw"] == counts["grad_output_gw"] == 0
    # In chunks of 128 rows (the smallest a chunk can be: whole weight blocks and whole column tiles), the
    # counts are the same.
    monkeypatch.setattr(cast_health, "CHUNK_ELEMENTS", 1000)
    assert [measure_cast(c, operands[c.operand])[2].item() for c in casts] == [counts[c.name] for c in casts]


def test_a_planted_outlier_shows_in_the_tiles_it_shares_and_nowhere_else():
    x = torch.ones(256, 256)
    x[3, :128] = 1e6   # one token's first tile: the tile along its row holds only the outlier values
    input_cast, weight_cast, _, _, input_gw = blockwise_casts(_blockwise(256, 256, power_of_2=False))
    # Along rows the outlier tile is uniform (no loss), the others hold ones: nothing flushes.
    assert measure_cast(input_cast, x).tolist() == [65536, 0, 0]
    # Down the columns each of the first 128 columns has one 1e6 among 127 ones in tokens 0..127: the ones fall
    # to 1 * 448 / 1e6 = 4.5e-4 < 2^-10 (half e4m3's smallest subnormal) and flush: 127 x 128 elements.
    assert measure_cast(input_gw, x).tolist() == [65536, 0, 127 * 128]
    # A weight outlier flushes its own 128x128 block only.
    w = torch.ones(256, 256)
    w[0, 0] = 1e6
    assert measure_cast(weight_cast, w).tolist() == [65536, 0, 128 * 128 - 1]


def _two_blockwise_layers(power_of_2: bool) -> nn.Sequential:
    first, second = _blockwise(256, 384, power_of_2=power_of_2), _blockwise(384, 256, power_of_2=power_of_2, seed=1)
    return nn.Sequential(first, nn.ReLU(), second)


@pytest.mark.parametrize("power_of_2", [False, True])
def test_collector_measures_blockwise_linears_on_their_micro_batch(power_of_2):
    model = _two_blockwise_layers(power_of_2)
    collector = Fp8StatsCollector([model], freq=1)
    x = torch.randn(2, 128, 256)
    x[0, 5] = 1e6   # one outlier token
    with collector.capture():
        model(x).square().mean().backward()
    health = {h.fqn: h for h in collector.collect()}
    first = health["0"]
    assert first.casts["weight"] == blockwise_casts(model[0])[1].describe()
    assert first.amax["input"] == pytest.approx(float(x.abs().max()))
    assert first.amax["weight"] == pytest.approx(float(model[0].weight.detach().abs().max()))
    x2d = x.reshape(-1, 256)
    for cast in blockwise_casts(model[0]):
        if cast.operand == "input":
            elements, _, flushed = measure_cast(cast, x2d).tolist()
            assert first.underflow[cast.name] == flushed / elements
    # The outlier token has tiles of its own along its row, but it shares its column tiles with tokens 0..127
    # (half the batch), whose elements below 2^-10 * 1e6 / 448 = 2.2 (97% of a Gaussian) flush.
    assert first.underflow["input"] == 0 and 0.45 < first.underflow["input_gw"] < 0.5
    with torch.no_grad():
        reference = x2d @ model[0].weight.t()
        fp8 = model[0](x2d)
    direct = 10 * math.log10(float(reference.square().sum()) / float((reference - fp8).square().sum()))
    # Same operands, same emulated forward: equal to float rounding of the energy sums.
    assert first.output_sqnr_db == pytest.approx(direct, abs=1e-6)
    assert 25 < first.output_sqnr_db < 35   # e4m3 (3 mantissa bits) on every tile: ~28-29 dB
    assert set(health["2"].saturated) == {"input", "weight", "grad_output", "grad_output_gw", "input_gw"}
    assert not model[0]._forward_hooks   # nothing stays installed


def test_a_weight_gathered_as_fp8_blocks_is_measured_from_its_master_weight():
    """With FSDP's blockwise FP8 all-gather the Linear computes with already quantized blocks (``_data``,
    ``_scale``): their zeros are no longer 'nonzero elements cast to 0', so the weight cast is measured on the
    master weight FSDP held before the forward, as for float8's all-gather."""
    model = _two_blockwise_layers(power_of_2=False)
    master = model[0].weight
    with torch.no_grad():
        master[0, 0] = 1e6   # flushes the rest of its 128x128 block
    x = torch.randn(128, 256)

    def weight_health(gathered: bool):
        collector = Fp8StatsCollector([model], freq=1)
        with collector.capture():
            if gathered:   # what FSDP's unsharded parameter looks like during the forward
                data, scale = quantize_128x128(master.detach(), power_of_2=False)
                weight = nn.Parameter(fake_128x128(master.detach(), power_of_2=False))
                weight._data, weight._scale = data, scale
                model[0].weight = weight
            model(x).square().mean().backward()
            model[0].weight = master
        return {h.fqn: h for h in collector.collect()}["0"]

    plain, gathered = weight_health(False), weight_health(True)
    # Every other element of the outlier's block (|w| < 0.07 < 2^-10 * 1e6 / 448) flushes; the 384 x 256 weight
    # holds 6 blocks. The dequantized blocks have those elements at 0 already: measured there, the share would be 0.
    assert plain.underflow["weight"] == (128 * 128 - 1) / (384 * 256)
    assert gathered.underflow["weight"] == plain.underflow["weight"]
    assert gathered.amax["weight"] == plain.amax["weight"] == 1e6


def test_fp8_stats_are_logged_for_a_blockwise_training_run(tmp_path, caplog):
    import logging

    import models  # noqa: F401  (registers the model families)
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.config import parse_cli

    argv = ["--config", "llama3_debug_fp8_blockwise", "--model.n_layers", "1", "--training.seq_len", "128",
            "--training.local_batch_size", "1", "--training.steps", "2", "--validation.enable", "false",
            "--checkpoint.enable", "false", "--metrics.cpu_peak_tflops", "1", "--metrics.fp8_stats_freq", "2",
            "--job.dump_folder", str(tmp_path)]
    trainer = parse_cli(argv, registry=DEFAULT_REGISTRY).config.build()
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        trainer.train()
    # Step 2 only; one block of the debug flavor: wq wk wv wo w1 w2 w3, every one blockwise.
    assert "fp8 stats step 2 (7 Linears); lowest output SQNR layers.0." in caplog.text
    assert "fp8 stats step 1 " not in caplog.text
