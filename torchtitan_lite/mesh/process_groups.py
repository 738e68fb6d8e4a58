"""Device and process-group helpers: the only place that knows whether CUDA is present."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def process_world_size() -> int:
    """The ranks of the job this process belongs to: WORLD_SIZE under torchrun, else 1."""
    return int(os.environ.get("WORLD_SIZE", 1))


def launch_world_size() -> int:
    """The world size a command is about: WORLD_SIZE under torchrun; before a launch, the processes
    run_train.sh will start (NGPU, else NPROC); else 1."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("NGPU") or os.environ.get("NPROC") or 1)


def requested_gpus() -> int | None:
    """NGPU as run_train.sh reads it: GPU processes per node, or None for a CPU launch."""
    value = os.environ.get("NGPU")
    return int(value) if value else None


def launch_device_type() -> str:
    """The device a command is about: this process's, or 'cuda' when NGPU announces a GPU launch (sized
    possibly from a login node without GPUs)."""
    return "cuda" if os.environ.get("NGPU") else device_type()


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
        timeout = timedelta(seconds=timeout_s)
        store = _per_attempt_agent_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend_for(kind), timeout=timeout)
        else:
            dist.init_process_group(backend=backend_for(kind), timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return device


def _per_attempt_agent_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's store with keys prefixed by the restart attempt, or None outside torchrun's agent.

    torchrun (``--max-restarts``) keeps one TCPStore for all attempts of a job. ``env://`` set-up
    writes its process-group keys unprefixed, so a restarted rank can read the address its killed
    predecessor published and fail to connect; prefixing by TORCHELASTIC_RESTART_COUNT gives every
    attempt its own namespace.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                           world_size=int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"torchtitan_lite/attempt_{attempt}/", client)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0
