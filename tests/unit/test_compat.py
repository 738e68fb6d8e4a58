"""torchtitan_lite.compat: the APIs that differ between torch releases behave the same on the installed one."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from _conversion import context

from torchtitan_lite import compat
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.distributed.float8_allgather import ByteViewAllGather


def test_all_gather_single_gathers_float8_bytes_without_a_deprecation_warning():
    if dist.is_initialized():
        pytest.skip("needs its own single-rank process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        source = torch.tensor([0.5, -2.0, 448.0, 1e-3]).to(torch.float8_e4m3fn)
        out = torch.empty_like(source)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch 2.13+ deprecates all_gather_into_tensor with a FutureWarning
            ByteViewAllGather()(out, source, dist.group.WORLD)
        # An all-gather copies bytes: one rank's result is bit-identical to its input.
        assert torch.equal(out.view(torch.uint8), source.view(torch.uint8))
    finally:
        dist.destroy_process_group()


def test_rowwise_probe_matches_what_cpu_scaled_mm_does():
    a = torch.full((16, 32), 2.0).to(torch.float8_e4m3fn)
    b = torch.full((32, 16), 0.5).to(torch.float8_e4m3fn).t().contiguous().t()
    row_scales, col_scales = torch.full((16, 1), 3.0), torch.full((1, 16), 0.25)
    if compat.cpu_scaled_mm_supports_rowwise():
        out = torch._scaled_mm(a, b, scale_a=row_scales, scale_b=col_scales, out_dtype=torch.float32)
        # 32 products of 2 * 0.5, times 3 * 0.25: exact in float32.
        assert torch.equal(out, torch.full((16, 16), 24.0))
        assert compat.float8_recipe_needs_emulation("rowwise", "cpu") is None
    else:
        with pytest.raises(RuntimeError):
            torch._scaled_mm(a, b, scale_a=row_scales, scale_b=col_scales, out_dtype=torch.float32)
        assert "supports per-tensor scales only" in compat.float8_recipe_needs_emulation("rowwise", "cpu")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_converter_emulates_rowwise_when_cpu_scaled_mm_lacks_row_scales(monkeypatch, caplog, recipe):
    monkeypatch.setattr(compat, "cpu_scaled_mm_supports_rowwise", lambda: False)
    with caplog.at_level(logging.WARNING):
        converter = Float8LinearConverter.Config(recipe_name=recipe).build(context=context("float32"))
    assert converter.float8_config.emulate is True
    assert f"CPU torch._scaled_mm supports per-tensor scales only, so the '{recipe}' recipe's per-row scales are " \
           f"emulated" in caplog.text


def test_tensorwise_and_cuda_are_never_emulated_by_the_probe(monkeypatch):
    monkeypatch.setattr(compat, "cpu_scaled_mm_supports_rowwise", lambda: False)
    assert compat.float8_recipe_needs_emulation("tensorwise", "cpu") is None
    assert compat.float8_recipe_needs_emulation("rowwise", "cuda") is None
    converter = Float8LinearConverter.Config(recipe_name="tensorwise").build(context=context("float32"))
    assert converter.float8_config.emulate is False
