"""Float8 all-gathers that also work on gloo, by moving the float8 bytes as uint8.

gloo has no float8 dtypes ("Invalid scalar type"), and two paths hand it float8 tensors:

- FSDP2 with ``enable_fsdp_float8_all_gather``: a parameter group whose all-gather inputs are all float8
  is gathered in a float8 buffer (groups that mix float8 with other dtypes already use uint8 bytes);
- tensor parallel with torchao's float8 styles: activations (forward) and output gradients (backward)
  are all-gathered as ``Float8TrainingTensor``, whose handler runs the functional all-gather on the raw
  float8 data.

An all-gather only copies bytes, so gathering the uint8 view and viewing the result back as float8 is
bit-identical on every backend, and the payload stays one byte per element.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from torchtitan_lite.compat import all_gather_single

FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a float8 tensor (same storage); other dtypes unchanged."""
    return t.view(torch.uint8) if t.dtype in FLOAT8_DTYPES else t


class ByteViewAllGather(AllGather):
    """FSDP2 all-gather that gathers float8 buffers through their uint8 view."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return all_gather_single(as_bytes(output_tensor), as_bytes(input_tensor), group=group, async_op=async_op)


def use_byte_view_all_gather(model: nn.Module) -> int:
    """Install `ByteViewAllGather` on every FSDP module of `model`; returns how many."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(ByteViewAllGather())
    return len(modules)


_patched = False


def enable_float8_tensor_all_gather_as_bytes() -> None:
    """Make torchao's Float8TrainingTensor all-gather move uint8 bytes (idempotent, process-wide).

    Replaces torchao's handler of the functional all-gather ops for Float8TrainingTensor with one that
    gathers the uint8 view of the float8 data; the scale (tensorwise, identical on every rank) is kept.
    The matching ``wait_tensor`` handler works unchanged: collectives are tracked by storage, which the
    float8 view shares with the uint8 result.
    """
    global _patched
    if _patched:
        return
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def all_gather_float8_as_bytes(aten_op: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        fp8_input = args[0]
        if not isinstance(fp8_input, Float8TrainingTensor):
            raise TypeError(f"expected a Float8TrainingTensor to all-gather, got {type(fp8_input).__name__}")
        if fp8_input._scale.numel() != 1:
            raise NotImplementedError("float8 all-gather needs a tensorwise (single) scale; rowwise recipes "
                                      "keep tensor-parallel communication in high precision")
        data = fp8_input._data.contiguous()
        gathered = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})).view(data.dtype)
        return Float8TrainingTensor(gathered, fp8_input._scale, fp8_input._orig_dtype,
                                    fp8_input._linear_mm_config, fp8_input._gemm_input_role)

    for op in (torch.ops.c10d_functional.all_gather_into_tensor.default,
               torch.ops._c10d_functional.all_gather_into_tensor.default):
        FLOAT8_OPS_TABLE[op] = all_gather_float8_as_bytes
    _patched = True
