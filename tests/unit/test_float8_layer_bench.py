"""scripts/float8_layer_bench.py (torchtitan_lite/tools/float8_layer_bench.py): shape parsing, the 8B presets, and the
CLI on a tiny eager shape."""
from __future__ import annotations

import pytest
import torch

from torchtitan_lite.tools import float8_layer_bench as bench


def test_llama3_8b_preset_has_the_published_linear_shapes():
    shapes = bench.parse_shapes(["llama3_8b"], 8192)
    # Llama 3.1 8B: dim 4096, 8 KV heads of 128, FFN 14336, vocabulary 128256. Linears of one shape are timed
    # once (each costs a compile per recipe, and blockwise an autotuning round) and counted twice in the sum.
    assert [(s.name, s.m, s.k, s.n, s.count) for s in shapes] == [
        ("wq, wo", 8192, 4096, 4096, 2), ("wk, wv", 8192, 4096, 1024, 2), ("w1, w3", 8192, 4096, 14336, 2),
        ("w2", 8192, 14336, 4096, 1), ("output", 8192, 4096, 128256, 1),
    ]
    assert shapes[0].train_flops == 6 * 8192 * 4096 * 4096


def test_explicit_shapes_and_errors():
    assert bench.parse_shapes(["16,32,48", "llama3_debug"], 64)[0] == bench.Shape("16x32x48", 16, 32, 48)
    with pytest.raises(ValueError, match=r"shape '16,32' is not M,K,N"):
        bench.parse_shapes(["16,32"], 64)
    with pytest.raises(ValueError, match=r"unknown shape preset 'llama3_9b'; use M,K,N or one of: .*llama3_8b"):
        bench.parse_shapes(["llama3_9b"], 64)


def test_each_variant_is_the_expected_module():
    from torchao.float8.float8_linear import Float8Linear

    hp = bench.make_variant(None, 32, 48, torch.float32, torch.device("cpu"), compile=False)
    assert type(hp) is torch.nn.Linear and hp.weight.shape == (48, 32)
    fp8 = bench.make_variant("rowwise", 32, 48, torch.float32, torch.device("cpu"), compile=False)
    assert isinstance(fp8, Float8Linear)
    assert fp8.config.cast_config_input.scaling_granularity.value == "axiswise"


def test_table_speedup_is_hp_time_over_fp8_time():
    shape = bench.Shape("s", 2, 3, 4)
    table = bench.format_table([(shape, {"hp": 0.002, "tensorwise": 0.001}), (shape, {"hp": 0.004, "tensorwise": 0.004})],
                               ["tensorwise"], "bfloat16")
    lines = table.splitlines()
    assert lines[0] == "| layer | M | K | N | bfloat16 ms | bfloat16 TFLOP/s | tensorwise ms | tensorwise speedup |"
    assert lines[2].endswith("| 2.000 | 7.2e-08 | 1.000 | 2.00x |")
    assert lines[-1] == "| all (sum) |  |  |  | 6.000 |  | 5.000 | 1.20x |"
    # A shape standing for two Linears counts twice in the sum.
    twice = bench.Shape("wq, wo", 2, 3, 4, count=2)
    total = bench.format_table([(twice, {"hp": 0.002, "tensorwise": 0.001}), (shape, {"hp": 0.004, "tensorwise": 0.004})],
                               ["tensorwise"], "bfloat16").splitlines()[-1]
    assert total == "| all (sum) |  |  |  | 8.000 |  | 6.000 | 1.33x |"


def test_cli_on_a_tiny_eager_shape(capsys):
    assert bench.main(["--shapes", "32,64,48", "--no-compile", "--dtype", "float32", "--warmup", "1", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "eager (no compile), float32 baseline" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 32x64x48 ")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["32x64x48", "32", "64", "48"]
    assert len(cells) == 6 + 2 * 3  # baseline ms + TFLOP/s, then ms + speedup per recipe
    assert all(float(c) > 0 for c in cells[4::2]) and all(c.endswith("x") for c in cells[7::2])
    # Each shape's line is printed as soon as it is measured (a run cut short keeps it), before the table.
    (progress,) = [line for line in out.splitlines() if line.startswith("measured ")]
    assert progress.startswith("measured 32x64x48: float32 ") and out.index(progress) < out.index("| layer |")
    assert [part.split(" ")[0] for part in progress.removeprefix("measured 32x64x48: ").split("; ")] == [
        "float32", "tensorwise", "rowwise", "rowwise_with_gw_hp"]


def test_cli_rejects_bad_shapes(capsys):
    assert bench.main(["--shapes", "0,64,48", "--no-compile"]) == 2
    assert "positive integers" in capsys.readouterr().err
