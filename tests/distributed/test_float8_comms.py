"""What float8 training puts on the wire: FSDP all-gathers 1 byte per float8 weight element, one batched
amax all-reduce per step with scale precompute, TP all-gathers activations and gradients in float8, and
all of it over gloo, which has no float8 dtypes.

The collectives come from the layout runs of test_parallel_layouts (step 1 of each variant, recorded
below DTensor and the float8 tensor subclasses, i.e. the tensors handed to the backend).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _harness import run_ranks
from _llama_steps import TINY, layout_results
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchtitan_lite.distributed.float8_allgather import use_byte_view_all_gather

DP = 2
LINEARS_PER_BLOCK = 7
_FLOAT32_BYTES = 4


def _block_elements() -> tuple[int, int]:
    """(float8 Linear weight elements, other parameter elements) of one transformer block."""
    d, kv, h = TINY.dim, TINY.n_kv_heads * TINY.head_dim, TINY.ffn_hidden_dim
    linear = d * d + 2 * d * kv + d * d + 3 * d * h  # wq, wk, wv, wo, w1, w2, w3
    return linear, 2 * d  # two RMSNorm weights


def _fwd_bwd(layout: str, variant: str):
    return layout_results(layout)[variant]["collectives"]["fwd_bwd"]


@pytest.mark.parametrize("variant, param_bytes, linear_bytes", [
    ("fp32", 4, 4),
    ("bf16", 2, 2),
    ("fp8", 4, 1),  # float8 Linear weights next to float32 norm weights
])
def test_fsdp_block_all_gather_bytes_per_linear_weight_element(variant, param_bytes, linear_bytes):
    linear, other = _block_elements()
    expected = (linear * linear_bytes + other * param_bytes) // DP
    gathers = [c for c in _fwd_bwd("fsdp2", variant) if c.op == "_allgather_base_"]
    block_gathers = [c for c in gathers if c.nbytes == expected]
    # Both blocks in forward, and the first block again in backward (the last one is not resharded).
    assert len(block_gathers) == 3, [(c.dtype, c.nbytes) for c in gathers]
    measured_per_element = (block_gathers[0].nbytes - other // DP * param_bytes) / (linear // DP)
    assert measured_per_element == linear_bytes
    if variant == "fp8":
        # Mixed float8 / float32 groups travel as raw bytes.
        assert block_gathers[0].dtype == torch.uint8


def test_scale_precompute_is_one_batched_all_reduce_instead_of_one_per_weight():
    float8_weights = LINEARS_PER_BLOCK * TINY.n_layers
    with_precompute = layout_results("fsdp2")["fp8"]["collectives"]
    precompute = [c for c in with_precompute["precompute"] if c.op == "all_reduce"]
    assert len(precompute) == 1 and precompute[0].numel == float8_weights
    assert [c for c in with_precompute["fwd_bwd"] if c.op == "all_reduce"] == []

    without = [c for c in _fwd_bwd("fsdp2", "fp8_no_precompute") if c.op == "all_reduce"]
    # One amax all-reduce per weight and all-gather: forward for every block, backward for the first.
    assert len(without) == float8_weights + LINEARS_PER_BLOCK
    assert all(c.numel == 1 for c in without)


@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2"])
def test_tensor_parallel_all_gathers_activations_and_gradients_in_float8(layout):
    high = [c for c in _fwd_bwd(layout, "fp32") if c.op == "all_gather_into_tensor"]
    low = [c for c in _fwd_bwd(layout, "fp8") if c.op == "all_gather_into_tensor"]
    assert len(low) == len(high)
    float8 = [(h, lo) for h, lo in zip(high, low) if lo.dtype == torch.uint8]
    # Forward: attention and FFN inputs of every block; backward: gradients of the wo and w2 outputs.
    assert len(float8) == 4 * TINY.n_layers
    for h, lo in float8:
        assert h.dtype == torch.float32 and lo.numel == h.numel and lo.nbytes * _FLOAT32_BYTES == h.nbytes
    # The rest (the vocabulary projection's input, kept in high precision) is unchanged.
    assert [(h.dtype, h.nbytes) for h, lo in zip(high, low) if lo.dtype != torch.uint8] == \
           [(lo.dtype, lo.nbytes) for lo in low if lo.dtype != torch.uint8]


@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2"])
def test_float8_tp_is_decided_per_region_when_wk_and_wv_stay_high_precision(layout):
    high = [c for c in _fwd_bwd(layout, "fp32") if c.op == "all_gather_into_tensor"]
    mixed = [c for c in _fwd_bwd(layout, "fp8_wk_wv_hp") if c.op == "all_gather_into_tensor"]
    assert len(mixed) == len(high)
    # The FFN input in forward and the wo / w2 output gradients in backward: 3 of the 4 regions per block
    # move 1 byte per element; the attention input (shared by wq and the high-precision wk / wv) and the
    # vocabulary projection's input are gathered exactly as in the float32 run.
    assert sum(lo.dtype == torch.uint8 for lo in mixed) == 3 * TINY.n_layers
    for h, lo in zip(high, mixed):
        if lo.dtype == torch.uint8:
            assert h.dtype == torch.float32 and lo.nbytes * _FLOAT32_BYTES == h.nbytes
        else:
            assert (lo.dtype, lo.nbytes) == (h.dtype, h.nbytes)


def test_fsdp_float8_allgather_on_fsdp_x_tp_moves_bytes():
    gathers = [c for c in _fwd_bwd("fsdp2_tp2", "fp8") if c.op == "_allgather_base_"]
    assert any(c.dtype == torch.uint8 for c in gathers)


# ------------------------------------------------------------------------------------------------
# A parameter group made only of float8 weights is gathered in a float8 buffer, which gloo rejects.


def _float8_stack_worker(rank: int, world_size: int) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), enable_fsdp_float8_all_gather=True)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))

    def build(mesh=None) -> nn.Module:
        torch.manual_seed(0)
        model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)),
                                           config=config)
        if mesh is not None:
            for layer in model:
                fully_shard(layer, mesh=mesh)  # each group holds a single float8 weight
            fully_shard(model, mesh=mesh)
        return model

    reference = build()(x)
    # The failing attempt gets its own process group: gloo keeps the error in the group it happened in.
    raw_error = ""
    try:
        build(DeviceMesh.from_group(dist.new_group(), "cpu"))(x)
    except RuntimeError as e:
        raw_error = str(e)
    sharded = build(init_device_mesh("cpu", (world_size,)))
    installed = use_byte_view_all_gather(sharded)
    out = sharded(x)
    out.sum().backward()
    return {"raw_error": raw_error, "installed": installed, "max_diff": float((out - reference).abs().max())}


def test_all_float8_parameter_group_all_gathers_over_gloo_as_bytes():
    result = run_ranks(_float8_stack_worker, 2)[0]
    # Without the byte view gloo refuses the float8 buffer; if this ever passes, gloo learned float8.
    assert "Invalid scalar type" in result["raw_error"]
    assert result["installed"] == 3
    # The same float8 weights and scales as the unsharded model: bit-identical output.
    assert result["max_diff"] == 0.0
