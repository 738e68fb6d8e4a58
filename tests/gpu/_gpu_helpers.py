"""Shared pieces of the CUDA-only tests: skip markers, the float8 converter for CUDA, and an NCCL launcher.

Every test module here sets ``pytestmark = pytest.mark.gpu``; tests/conftest.py skips them with
"needs CUDA" where torch sees no GPU, so on CPU they are collected and reported, never silently absent.
"""
from __future__ import annotations

import io
import multiprocessing
import os
import queue as queue_module
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_lite.components.quantization.float8 import MIN_FP8_CAPABILITY, Float8LinearConverter
from torchtitan_lite.protocols.model_converter import ConversionContext


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    # Without any GPU the "needs CUDA" skip of tests/conftest.py names the reason instead.
    return pytest.mark.skipif(0 < gpu_count() < n, reason=f"needs {n}+ GPUs (found {gpu_count()})")


def _has_fp8() -> bool:
    return gpu_count() > 0 and torch.cuda.get_device_capability() >= MIN_FP8_CAPABILITY


needs_fp8 = pytest.mark.skipif(gpu_count() > 0 and not _has_fp8(),
                               reason="needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or newer)")


def float8_converter(recipe: str = "tensorwise", *, fsdp: bool = False, all_gather: bool = False,
                     precompute: bool = False, emulate: bool = False,
                     param_dtype: torch.dtype = torch.bfloat16) -> Float8LinearConverter:
    """The converter as a CUDA run resolves it (no autocast: the tests hold parameters in ``param_dtype``)."""
    context = ConversionContext(device_type="cuda", param_dtype=param_dtype, autocast=False, fsdp_sharded=fsdp,
                                tp_enabled=False, compile_model=True, seq_len=128,
                                output_module="output", blocks="layers")
    return Float8LinearConverter.Config(recipe_name=recipe, enable_fsdp_float8_all_gather=all_gather,
                                        precompute_float8_dynamic_scale_for_fsdp=precompute,
                                        emulate=emulate).build(context=context)


def mlp(dim: int = 256, hidden: int = 512, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    """Linears large enough for every FP8 recipe's GEMM constraints (dimensions divisible by 16)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, dim, bias=False)).to(
        device="cuda", dtype=dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


# --------------------------------------------------------------------------------------------------
# NCCL processes, one per GPU


def run_nccl(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """Results of ``fn(rank, world_size, *args)`` on ``world_size`` processes, one GPU each, joined by NCCL."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    results_queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results_queue), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = results_queue.get(timeout=timeout_s)
            except queue_module.Empty:
                errors.append(f"no result within {timeout_s:.0f} s")
                break
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _entry(fn, rank: int, world_size: int, port: int, args, results_queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        result = fn(rank, world_size, *args)
        dist.barrier()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results_queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results_queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
