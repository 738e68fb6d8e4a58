"""Bytes of optimizer state per parameter, for torch Adam/AdamW and torchao's low-bit AdamW.

torch (torch/optim/adam.py, `_init_group`): `exp_avg` and `exp_avg_sq` are `zeros_like(param)` (float32
here: master weights are float32) and `step` is a float32 scalar tensor, kept on the host unless the
fused or capturable kernel is used.

torchao 0.18 (torchao/optim/adam.py `_AdamBase._new_buffer`, subclass_8bit.py, subclass_4bit.py,
subclass_fp8.py): each moment of a parameter whose local shard has >= 4096 elements and a multiple of
the block size is a tensor subclass made of

- AdamW8bit (block 256): uint8 `codes` (1 byte / element), float32 `scale` per block, float32 `qmap`
  lookup table of 256 entries;
- AdamW4bit (block 128): two 4-bit codes packed per uint8 (0.5 byte / element), float32 `scale` per
  block, float32 `qmap` of 16 entries;
- AdamWFp8 (block 256): float8_e4m3fn `codes` (1 byte / element), float32 `scale` per block, no qmap.

Any other parameter gets plain `zeros_like` moments (4 bytes / element), and `step` is a float32 host
scalar. The layout numbers (block sizes, qmap lengths) are read from torchao itself below, so a torchao
upgrade that changes them changes the estimate with it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

MOMENTS = 2
"""exp_avg and exp_avg_sq (amsgrad is not offered by the optimizer section)."""
STEP_BYTES = 4
"""The float32 `step` scalar each parameter's state holds."""
TORCHAO_MIN_QUANTIZED_NUMEL = 4096
"""torchao quantizes only local shards with at least this many elements (bitsandbytes' rule)."""

_LOW_BIT_CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8"}


@dataclass(frozen=True)
class LowBitLayout:
    block_size: int
    code_bytes_per_element: float
    qmap_entries: int
    """Float32 lookup-table entries stored with each quantized moment (0: no table)."""

    def moment_bytes(self, numel: int) -> int:
        return int(numel * self.code_bytes_per_element) + 4 * (numel // self.block_size) + 4 * self.qmap_entries


@cache
def low_bit_layout(low_bit: str) -> LowBitLayout:
    """Block size (the torchao class's default, which the optimizer component keeps), code width and
    qmap length for `optimizer.low_bit`."""
    import torchao.optim
    from torchao.optim import subclass_4bit, subclass_8bit

    cls = getattr(torchao.optim, _LOW_BIT_CLASSES[low_bit])
    block_size = inspect.signature(cls.__init__).parameters["block_size"].default
    if low_bit == "adamw8bit":
        # Signed (exp_avg) and unsigned (exp_avg_sq) tables have the same length.
        return LowBitLayout(block_size, 1.0, len(subclass_8bit.get_qmap_signed()))
    if low_bit == "adamw4bit":
        return LowBitLayout(block_size, 0.5, len(subclass_4bit.get_qmap_signed()))
    return LowBitLayout(block_size, 1.0, 0)


def state_bytes(local_numel: int, low_bit: str | None, *, param_bytes: int = 4) -> int:
    """Optimizer state bytes of one parameter whose local shard has `local_numel` elements."""
    if low_bit is not None:
        layout = low_bit_layout(low_bit)
        if local_numel >= TORCHAO_MIN_QUANTIZED_NUMEL and local_numel % layout.block_size == 0:
            return MOMENTS * layout.moment_bytes(local_numel) + STEP_BYTES
    return MOMENTS * local_numel * param_bytes + STEP_BYTES


def step_temporary_bytes(local_numels: list[int], *, low_bit: str | None, implementation: str,
                         device_type: str, param_bytes: int = 4) -> tuple[int, str]:
    """Peak scratch memory of one optimizer step, and how it arises.

    - fused (what 'auto' picks on CUDA and CPU): updates in place, no scratch;
    - foreach: `torch._foreach_sqrt(exp_avg_sqs)` materialises one tensor per parameter at once
      (torch/optim/adam.py `_multi_tensor_adam`), i.e. one more copy of all parameters;
    - for-loop: the same denominator, one parameter at a time;
    - torchao low-bit: a compiled update per parameter that dequantizes both moments and the weight to
      float32 (`single_param_adam`), bounded here by three float32 copies of the largest parameter.
    """
    if not local_numels:
        return 0, "no parameters"
    largest = max(local_numels)
    if low_bit is not None:
        return 3 * 4 * largest, "torchao per-parameter update: <= 3 fp32 copies of the largest parameter"
    if implementation == "auto":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        implementation = "fused" if device_type in _get_fused_kernels_supported_devices() else "foreach"
    if implementation == "fused":
        return 0, "fused kernel: in place"
    if implementation == "foreach":
        return sum(local_numels) * param_bytes, "foreach: one sqrt(exp_avg_sq) copy of all parameters"
    return largest * param_bytes, "for-loop: sqrt(exp_avg_sq) of the largest parameter"
