"""The MoE families' run rules (their ``check_run``s): what the experts' split over tp and their compiled
grouped GEMM need of a run, refused before launch by --check-config."""
from __future__ import annotations

import torch


def check_expert_tp(hidden_dim: int, tp: int, grouped_mm: bool) -> None:
    """Expert tensor parallelism splits every expert's (and each shared expert's) hidden dim over the tp ranks:
    it must divide, and under torch._grouped_mm each slice must keep its 16-byte aligned strides."""
    if hidden_dim % tp:
        raise ValueError(
            f"parallelism.tp={tp} must divide the MoE experts' hidden_dim={hidden_dim} (expert tensor parallelism "
            f"gives each rank hidden_dim / tp channels of every expert); use a tp among the divisors of "
            f"{hidden_dim}, or data parallelism (parallelism.dp_shard) instead")
    if grouped_mm and (hidden_dim // tp) % 8:
        raise ValueError(
            f"parallelism.tp={tp} leaves each rank {hidden_dim // tp} of the experts' hidden_dim={hidden_dim} "
            "channels, not a multiple of 8: torch._grouped_mm needs 16-byte aligned strides in bfloat16; use a "
            "smaller tp, or set the flavor's moe.use_grouped_mm=False to run the per-expert loop")


def check_grouped_mm_compile_dtype(grouped_mm: bool, compile_model: bool, compute_dtype: torch.dtype | None) -> None:
    """torch._grouped_mm runs in any float dtype eagerly, but its traced (meta) form in torch 2.13 accepts only
    bfloat16 operands: a compiled float32 / float16 model would fail inside the compiler."""
    if compile_model and grouped_mm and compute_dtype not in (None, torch.bfloat16):
        raise ValueError(
            f"compiling grouped MoE experts needs bfloat16 compute, but precision.param_dtype is "
            f"{str(compute_dtype).removeprefix('torch.')} (torch._grouped_mm is traced for bfloat16 only); set "
            "--precision.param_dtype bfloat16 or --compile.enable false")
