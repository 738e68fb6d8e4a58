"""Device and process-group helpers: the only place that knows whether CUDA is present."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_distributed(timeout_s: int = 300) -> torch.device:
    """Initialise the default process group from torchrun's environment, if launched by it.

    Returns the device this rank computes on. A plain ``python train.py`` (no WORLD_SIZE) runs
    without a process group.
    """
    kind = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(kind, local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend=backend_for(kind), timeout=timedelta(seconds=timeout_s))
    return device


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0
