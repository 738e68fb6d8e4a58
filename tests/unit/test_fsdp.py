"""apply_fsdp argument checks, made before any sharding (the sharding itself: tests/distributed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.distributed.fsdp import apply_fsdp


def test_cpu_offload_needs_cuda():
    with pytest.raises(ValueError, match="fsdp_cpu_offload=true needs CUDA, but the mesh is on 'cpu'"):
        apply_fsdp(nn.Linear(2, 2), SimpleNamespace(device_type="cpu"), LLAMA3_PARALLEL_PLAN, cpu_offload=True)


def test_unknown_reshard_policy_is_refused():
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward='sometimes' must be 'default', 'always' or 'never'"):
        apply_fsdp(nn.Linear(2, 2), SimpleNamespace(device_type="cpu"), LLAMA3_PARALLEL_PLAN, reshard_after_forward="sometimes")
