"""torchao's float8 tensor-parallel styles over NCCL on 2 GPUs, against the same FP8 model unsharded."""
from __future__ import annotations

import copy

import pytest
import torch
from _gpu_helpers import float8_converter, mlp, needs_fp8, needs_gpus, rel_err, run_nccl

pytestmark = [pytest.mark.gpu, needs_fp8, needs_gpus(2)]


def tp_float8_against_plain(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    mesh = init_device_mesh("cuda", (world_size,))
    plain = mlp()
    float8_converter().convert(plain)
    parallel = copy.deepcopy(plain)
    # Sequence parallel as the Llama plan uses it: the input arrives sharded on the sequence, is
    # all-gathered in float8 for the column-parallel Linear, and the row-parallel output is reduce-scattered.
    parallelize_module(parallel, mesh, {
        "0": Float8ColwiseParallel(input_layouts=Shard(0)),
        "2": Float8RowwiseParallel(output_layouts=Shard(0)),
    })
    assert PrepareFloat8ModuleInput is not None  # the third style the plan uses, importable on this torchao
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = 512 // world_size
    x_plain, x_local = x.clone().requires_grad_(), x[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    out_plain = plain(x_plain)
    out_plain.backward(grad_out)
    out_local = parallel(x_local)
    out_local.backward(grad_out[rank * rows:(rank + 1) * rows])
    sl = slice(rank * rows, (rank + 1) * rows)
    return {"out": rel_err(out_local, out_plain[sl]), "dx": rel_err(x_local.grad, x_plain.grad[sl])}


def test_float8_tp_styles_match_the_unsharded_model():
    for result in run_nccl(tp_float8_against_plain, 2):
        # Tensorwise scales come from the whole tensor in both layouts (DTensor reduces the amax), so the
        # float8 values agree; sharded GEMMs sum in a different order and round to bf16 at the shard
        # boundary, well under 2%; a wrong layout or a per-shard scale is O(1).
        assert result["out"] < 0.02
        assert result["dx"] < 0.02
