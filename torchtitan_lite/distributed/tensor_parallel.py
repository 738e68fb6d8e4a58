"""Tensor parallelism (Megatron column/row split), sequence parallelism and vocab-parallel loss for Llama.

Plan per block: wq/wk/wv/w1/w3 are split by output columns, wo/w2 by input rows, so each block needs one
all-gather in (attention and FFN inputs) and one reduce(-scatter) out. With sequence parallelism the norms
and the residual stream between blocks are sharded along the sequence (Shard(1)), turning the all-reduce
into reduce-scatter + all-gather and sharding norm activations. With loss parallelism the logits stay
sharded by vocabulary (Shard(-1)) and cross-entropy runs on the shards.

Blocks whose Linears are all torchao tensorwise Float8Linear use torchao's float8 styles: the activation
is cast to float8 before the all-gather, so TP communication moves one byte per element (and output
gradients are all-gathered in float8 in backward). Row-wise float8 recipes keep the plain styles: their
per-row scales cannot be gathered with the data, so TP communication stays in high precision.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

logger = logging.getLogger(__name__)

_BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def is_float8_tensorwise(module: nn.Module) -> bool:
    """True for a torchao Float8Linear whose input, weight and output-gradient casts are all tensorwise."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_weight,
             module.config.cast_config_grad_output)
    return all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> int:
    """Parallelize `model` (torchtitan Llama names) over `tp_mesh` in place; returns the number of blocks
    that use float8 communication."""
    if tp_mesh.device_type == "cpu":
        from torchtitan_lite.distributed.float8_allgather import enable_float8_tensor_all_gather_as_bytes

        enable_float8_tensor_all_gather_as_bytes()
    # Layout of the residual stream between TP regions: sharded along the sequence, or whole.
    residual = Shard(1) if sequence_parallel else Replicate()
    norm_style = SequenceParallel() if sequence_parallel else None
    root_plan = {
        "tok_embeddings": _EmbeddingParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if norm_style is not None:
        root_plan["norm"] = norm_style
    parallelize_module(model, tp_mesh, root_plan)

    float8_blocks = 0
    for block in model.layers.values():
        float8 = all(is_float8_tensorwise(block.get_submodule(fqn)) for fqn in _BLOCK_LINEARS)
        float8_blocks += float8
        colwise, rowwise, prepare_input = _styles(float8)
        plan = {
            "attention": prepare_input(input_layouts=(residual, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=residual),
            "feed_forward": prepare_input(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=residual),
            "feed_forward.w3": colwise(),
        }
        if norm_style is not None:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    logger.info("applied TP %d%s%s to %d blocks (%d with float8 all-gather)", tp_mesh.size(),
                " + sequence parallel" if sequence_parallel else "", " + loss parallel" if loss_parallel else "",
                len(model.layers), float8_blocks)
    return float8_blocks


class _EmbeddingParallel(RowwiseParallel):
    """Vocabulary-sharded embedding whose output redistribution completes before the first block.

    RowwiseParallel hands on an AsyncCollectiveTensor (the reduce waits at first use). Fed to a compiled
    block, its gradient comes back as a plain tensor that the redistribution's backward cannot take, so
    the wait happens here; the block's first op would wait at once anyway.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def _styles(float8: bool):
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def loss_parallel_enabled(parallel_dims, config) -> bool:
    return parallel_dims.tp_enabled and config.parallelism.enable_loss_parallel


def loss_parallel_context(parallel_dims, config) -> contextlib.AbstractContextManager:
    """Context for computing the loss (and its backward) on vocab-sharded logits; a no-op without it."""
    return loss_parallel() if loss_parallel_enabled(parallel_dims, config) else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """Plain tensor from the (replicated) DTensor loss that loss parallelism returns."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
