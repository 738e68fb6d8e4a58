"""FSDP2 all-gather of blockwise FP8 weights: each rank quantizes its own shard into 128x128 blocks and FSDP
gathers the E4M3 data plus one float32 scale per block (1 + 4/16384 bytes per element instead of 2 for bf16).

A 128x128 block is the same block transposed, so the gathered copy serves the forward GEMM ``Y = X Wᵀ``
and the input-gradient GEMM ``dX = dY W`` without quantizing again (blockwise_fp8.py). When every FSDP shard
holds whole 128-row blocks, each block lies on one rank and is quantized there from its own amax: the
gathered copy is bit for bit the quantization of the full weight, with no amax all-reduce.

- ``BlockwiseShardWeight`` wraps the high-precision weight before ``fully_shard`` (as torchao's
  ``WeightWithDynamicFloat8CastTensor`` does for tensorwise); the optimizer and checkpoints see its values.
  Its ``fsdp_pre_all_gather`` casts the local shard to FSDP's parameter dtype (what a high-precision
  all-gather would have delivered) and quantizes it; ``fsdp_post_all_gather`` wraps what came back.
- ``BlockwiseGatheredWeight`` is the unsharded parameter the Linear computes with: E4M3 data N x K and scales
  N/128 x K/128, presenting itself as an N x K tensor of the parameter dtype. ``BlockwiseFP8Linear`` reads the
  blocks directly; any other op sees the dequantized values.

``fp8_all_gather_obstacle`` says when a layout cannot (the shard boundaries cut blocks): that weight is then
left unwrapped and FSDP gathers it in the parameter dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from torchtitan_lite.components.quantization.blockwise_fp8 import BLOCK, dequantize_128x128, quantize_128x128

SCALE_BYTES = 4
"""One float32 scale per 128x128 block."""
FP8_ALL_GATHER_BYTES_PER_ELEMENT = 1 + SCALE_BYTES / (BLOCK * BLOCK)
"""E4M3 data plus the block scales, per weight element gathered."""


def fp8_all_gather_obstacle(out_features: int, in_features: int, *, dp_shard: int, tp: int,
                            tp_shard_dim: int | None) -> str:
    """Why FSDP cannot gather this blockwise weight as FP8 blocks quantized on each rank, or ''.

    FSDP2 shards dim 0 of the (TP-local) weight in ``dp_shard`` chunks of ceil(rows / dp_shard) rows; each
    chunk must hold whole 128-row blocks for the quantization to stay local."""
    if dp_shard == 1:
        # FSDP2 then copies the shard without a collective (and takes a single all-gather input).
        return "dp_shard=1: FSDP gathers nothing"
    rows = out_features // tp if tp_shard_dim == 0 else out_features
    cols = in_features // tp if tp_shard_dim == 1 else in_features
    where = f"{rows} rows{' per TP rank' if tp_shard_dim == 0 and tp > 1 else ''}"
    if cols % BLOCK:
        return f"{cols} columns per TP rank are not whole {BLOCK}-column blocks"
    if rows % dp_shard:
        return f"{where} do not split evenly over dp_shard={dp_shard} (FSDP pads the last shard)"
    if (rows // dp_shard) % BLOCK:
        return (f"{where} / dp_shard={dp_shard} = {rows // dp_shard} rows per FSDP shard, not whole {BLOCK}-row "
                f"blocks (a block would span two ranks)")
    return ""


# Ops FSDP and DTensor run on the sharded weight (sharding, padding, copying, offloading) whose results are
# still the weight: they keep the wrapper. Everything else (optimizer maths, norms, reads) sees the plain values.
_KEEPS_SHARD_WRAPPER = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class BlockwiseShardWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers as 128x128-block FP8 (see the module docstring)."""

    _tensor: torch.Tensor
    power_of_2: bool

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, power_of_2: bool) -> BlockwiseShardWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            memory_format=suggest_memory_format(tensor), dtype=tensor.dtype, layout=tensor.layout,
            device=tensor.device, pin_memory=tensor.is_pinned(), requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, power_of_2: bool) -> None:
        self._tensor = tensor
        self.power_of_2 = power_of_2

    def __repr__(self) -> str:  # type: ignore[override]
        return f"BlockwiseShardWeight({self._tensor!r}, power_of_2={self.power_of_2})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # a classmethod, as torch documents subclasses
            cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func == torch.ops.aten.detach.default:
            return BlockwiseShardWeight(args[0]._tensor, args[0].power_of_2)
        power_of_2 = next(a.power_of_2 for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEPS_SHARD_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: BlockwiseShardWeight(t, power_of_2), out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_tensor"], {"power_of_2": self.power_of_2}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> BlockwiseShardWeight:
        return BlockwiseShardWeight(inner["_tensor"], meta["power_of_2"])

    # FSDP2's all-gather extension (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        shard = self._tensor
        rows, cols = shard.shape
        if rows % BLOCK or cols % BLOCK:
            raise ValueError(f"a blockwise FP8 all-gather needs whole {BLOCK}x{BLOCK} blocks in every FSDP shard, but "
                             f"this rank holds {rows} x {cols} of a {tuple(outer_size)} weight: the converter planned "
                             f"for another shard degree than FSDP's mesh ({mesh.size()} ranks); pass that degree as "
                             f"ConversionContext.dp_shard")
        if mp_policy is not None and mp_policy.param_dtype is not None:
            shard = shard.to(mp_policy.param_dtype)
        data, scale = quantize_128x128(shard, power_of_2=self.power_of_2)
        # FSDP concatenates each input along dim 0: the ranks' row blocks, and their rows of block scales.
        return (data, scale), None

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        data, scale = all_gather_outputs
        if out is not None:
            # A later all-gather refills the same output buffers; point at them again all the same.
            gathered = out._local_tensor if hasattr(out, "_local_tensor") else out
            if not isinstance(gathered, BlockwiseGatheredWeight):
                raise TypeError(f"expected the BlockwiseGatheredWeight of an earlier all-gather, got {type(out)}")
            gathered._data, gathered._scale = data, scale
            return None
        return BlockwiseGatheredWeight(data, scale, param_dtype), (data, scale)


class BlockwiseGatheredWeight(torch.Tensor):
    """An all-gathered blockwise FP8 weight: E4M3 ``_data`` N x K, float32 ``_scale`` N/128 x K/128, seen as
    an N x K tensor of the parameter dtype."""

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> BlockwiseGatheredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self._data = data
        self._scale = scale

    def __repr__(self) -> str:  # type: ignore[override]
        return f"BlockwiseGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantize(self) -> torch.Tensor:
        """The weight's values (the blocks dequantized) in its dtype."""
        return dequantize_128x128(self._data, self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # a classmethod, as torch documents subclasses
            cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        weight = args[0]
        # FSDP makes the unsharded parameter with as_strided to the full size and nn.Parameter (detach).
        same_view = func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default) and \
            tuple(args[1]) == tuple(weight.shape)
        if isinstance(weight, cls) and (same_view or func in (torch.ops.aten.detach.default,
                                                               torch.ops.aten.alias.default)):
            return BlockwiseGatheredWeight(weight._data, weight._scale, weight.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> BlockwiseGatheredWeight:
        return BlockwiseGatheredWeight(inner["_data"], inner["_scale"], meta["dtype"])


def wrap_for_fp8_all_gather(linear: torch.nn.Linear, *, power_of_2: bool) -> None:
    """Make FSDP all-gather ``linear``'s weight as blockwise FP8 (before ``fully_shard``)."""
    weight = linear.weight
    linear.weight = torch.nn.Parameter(BlockwiseShardWeight(weight.data, power_of_2),
                                       requires_grad=weight.requires_grad)
