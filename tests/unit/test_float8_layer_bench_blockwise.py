"""scripts/float8_layer_bench.py --recipes blockwise: the variant is the converter's blockwise Linear (emulated on a
CPU, and the header says so), shapes must be multiples of 128, and it is not timed unless asked for."""
from __future__ import annotations

import torch

from torchtitan_lite.components.quantization.blockwise_linear import BlockwiseFP8Linear
from torchtitan_lite.tools import float8_layer_bench as bench


def test_the_blockwise_variant_is_an_emulated_blockwise_linear_on_cpu():
    module = bench.make_variant("blockwise", 128, 256, torch.bfloat16, torch.device("cpu"), compile=True, tokens=64)
    assert type(module) is BlockwiseFP8Linear and module.emulate and not module.power_of_2   # never compiled
    assert module.weight.shape == (256, 128) and module.weight.dtype == torch.bfloat16
    assert "blockwise" not in bench.parse_args([]).recipes   # timed on request only


def test_cli_times_blockwise_next_to_tensorwise_and_says_it_is_emulated(capsys):
    argv = ["--shapes", "128,128,256", "--recipes", "tensorwise", "blockwise", "--no-compile", "--dtype", "bfloat16",
            "--warmup", "1", "--iters", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "blockwise: blockwise GEMMs emulated: this run computes on cpu; torchao's blockwise kernels need an sm_90 " \
           "GPU" in out and "(eager; NOT the kernels' speed)" in out
    header = next(line for line in out.splitlines() if line.startswith("| layer |"))
    assert header.endswith("| tensorwise ms | tensorwise speedup | blockwise ms | blockwise speedup |")
    (row,) = [line for line in out.splitlines() if line.startswith("| 128x128x256 ")]
    assert row.strip().endswith("x |")


def test_shapes_that_are_not_whole_blocks_are_refused_before_timing(capsys):
    assert bench.main(["--shapes", "128,128,256", "64,96,128", "--recipes", "blockwise", "--no-compile"]) == 2
    err = capsys.readouterr().err
    assert "--recipes blockwise needs K and N multiples of 128 (128x128 weight blocks); not: 64x96x128 (96 x 128)" in err
