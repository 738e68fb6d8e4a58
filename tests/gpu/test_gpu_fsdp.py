"""FSDP2 with float8 all-gather and precomputed scales over NCCL: same losses as the unsharded FP8 model,
and the precomputed scale of every sharded weight is the one of the whole weight."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _gpu_helpers import float8_converter, mlp, needs_fp8, needs_gpus, run_nccl

pytestmark = [pytest.mark.gpu, needs_fp8]

STEPS = 4


def fsdp_float8_against_plain(rank: int, world_size: int) -> dict:
    """On every rank: the same data through an unsharded FP8 model and an FSDP2 FP8 model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    mesh = init_device_mesh("cuda", (world_size,))
    plain = mlp(dtype=torch.float32)
    sharded = copy.deepcopy(plain)
    float8_converter(param_dtype=torch.float32).convert(plain)
    converter = float8_converter(fsdp=True, all_gather=True, precompute=True, param_dtype=torch.float32)
    converter.convert(sharded)
    assert converter.fsdp_float8_all_gather and converter.precompute_scales
    for layer in sharded:
        if isinstance(layer, Float8Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt_sharded = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(0)  # same data on every rank: FSDP's mean = one device
    x = torch.randn(256, 256, device="cuda", generator=gen)
    losses = []
    for _ in range(STEPS):
        pair = []
        for model, opt in ((plain, opt_plain), (sharded, opt_sharded)):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        converter.post_optimizer_hook([sharded])
        losses.append(pair)

    scale_errors = []
    for layer in sharded:
        if not isinstance(layer, Float8Linear):
            continue
        local = layer.weight._local_tensor
        amax = local._tensor.abs().max().to(torch.float64)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        expected = torch.finfo(torch.float8_e4m3fn).max / amax
        scale_errors.append(float((local._precomputed_scale.to(torch.float64) - expected).abs() / expected))
    return {"losses": losses, "scale_errors": scale_errors}


def _check(results: list[dict]) -> None:
    for result in results:
        for step, (plain, sharded) in enumerate(result["losses"]):
            # Identical float8 values (the all-gathered weight is cast with the whole weight's scale) and
            # identical data: only the reduce-scatter's mean and kernel order differ, ~1e-6 relative; the
            # updates stay in lockstep, so 1e-3 fails only on a wrong scale or a stale weight.
            assert sharded == pytest.approx(plain, rel=1e-3), f"step {step}"
        assert len(result["scale_errors"]) == 2
        # float32 scale against the float64 one: float32 rounding only.
        assert max(result["scale_errors"]) < 1e-6


def test_fsdp_float8_all_gather_and_precompute_on_one_gpu():
    _check(run_nccl(fsdp_float8_against_plain, 1))


@needs_gpus(2)
def test_fsdp_float8_all_gather_and_precompute_on_two_gpus():
    _check(run_nccl(fsdp_float8_against_plain, 2))
