"""The CPU _scaled_mm that replaces a slow native kernel computes what _scaled_mm means: the exact product of the
dequantized FP8 operands, rounded once to out_dtype, whatever the shape (a shard of a GEMM agrees with the whole)."""
import subprocess
import sys

import pytest
import torch

from torchtitan_lite.cpu_scaled_mm import scaled_mm_float64


def _operands(rows: int = 48, inner: int = 80, cols: int = 32):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(rows, inner, generator=g) * 4).to(torch.float8_e4m3fn)
    b = torch.randn(cols, inner, generator=g).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    row_scales = torch.rand(rows, 1, generator=g) + 0.5
    col_scales = torch.rand(1, cols, generator=g) + 0.5
    return a, b, row_scales, col_scales


def _reference(a, b, scale_a, scale_b, bias=None):
    out = (a.double() @ b.double()) * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rowwise", [False, True])
def test_matches_the_float64_product_of_the_fp8_values(rowwise):
    a, b, row_scales, col_scales = _operands()
    scale_a, scale_b = (row_scales, col_scales) if rowwise else (torch.tensor(0.7), torch.tensor(1.3))
    bias = torch.randn(b.shape[1], generator=torch.Generator().manual_seed(1))
    out = scaled_mm_float64(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.float32)
    expected = _reference(a, b, scale_a, scale_b, bias)
    # Exact: the same float64 arithmetic rounded once (the products of FP8 values and their sum over 80 terms are
    # exact in float64; only the scalings round, identically). A dropped scale is off by 30-50%.
    assert torch.equal(out, expected.float())
    dropped = scaled_mm_float64(a, b, scale_a, torch.ones_like(scale_b), bias=bias, out_dtype=torch.float32)
    assert not torch.allclose(dropped.double(), expected, rtol=1e-2, atol=1e-2)


def test_a_column_shard_equals_the_columns_of_the_whole_gemm():
    """Tensor parallelism computes a GEMM's columns on separate ranks: bitwise the same columns as the whole."""
    a, b, row_scales, col_scales = _operands(rows=64, inner=256, cols=96)
    whole = scaled_mm_float64(a, b, row_scales, col_scales, out_dtype=torch.bfloat16)
    half = scaled_mm_float64(a, b[:, :48], row_scales, col_scales[:, :48], out_dtype=torch.bfloat16)
    assert torch.equal(half, whole[:, :48])


def test_rounds_once_to_bfloat16():
    a, b, row_scales, col_scales = _operands()
    out = scaled_mm_float64(a, b, row_scales, col_scales, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _reference(a, b, row_scales, col_scales).to(torch.bfloat16))


def test_refuses_blockwise_scales_and_fp8_outputs():
    a, b, _, _ = _operands(rows=128, inner=128, cols=128)
    with pytest.raises(NotImplementedError, match=r"scale_a with one element or shape \(128, 1\), got \(128, 1, 1\)"):
        scaled_mm_float64(a, b, torch.ones(128, 1, 1), torch.ones(()), out_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="not torch.float8_e4m3fn"):
        scaled_mm_float64(a, b, torch.ones(()), torch.ones(()))
    with pytest.raises(NotImplementedError, match="takes no scale_result"):
        scaled_mm_float64(a, b, torch.ones(()), torch.ones(()), scale_result=torch.ones(()), out_dtype=torch.float32)


def test_registered_kernel_serves_torch_scaled_mm():
    """Forced on (a rate no kernel reaches), torch._scaled_mm on CPU is this module's function, bit for bit; in a
    child process, because the registration holds for the process."""
    code = (
        "import torch\n"
        "from torchtitan_lite import cpu_scaled_mm as m\n"
        "m.use_fast_cpu_scaled_mm.cache_clear(); m._library = None\n"
        "m.MIN_GFLOPS = float('inf')\n"
        "assert m.use_fast_cpu_scaled_mm()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)\n"
        "b = torch.randn(16, 64, generator=g).to(torch.float8_e4m3fn).t()\n"
        "sa, sb = torch.rand(32, 1, generator=g), torch.rand(1, 16, generator=g)\n"
        "out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)\n"
        "assert torch.equal(out, m.scaled_mm_float64(a, b, sa, sb, out_dtype=torch.bfloat16))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
