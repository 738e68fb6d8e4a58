"""Activation checkpointing per transformer block: none, full, selective by op, selective every Nth block.

A checkpointed block keeps only its input for backward and recomputes its forward there. Selective by op
keeps the outputs of the expensive or non-recomputable ops (attention, every other matmul, the float8
amax reductions that set scales, tensor-parallel reduce-scatters) and recomputes the cheap elementwise
rest (norms, SiLU, rotary, casts), trading a little memory for most of the recompute cost.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

logger = logging.getLogger(__name__)

_aten = torch.ops.aten

MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default})
"""Matmuls: every second one (in forward order) is recomputed, the others are saved."""

ATTENTION_OPS = frozenset({
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})

ALWAYS_SAVED_OPS = ATTENTION_OPS | frozenset({
    # Float8 scales come from amax reductions; saving them keeps recompute from re-reducing whole tensors.
    _aten.max.default,
    _aten.amax.default,
    # A recomputed collective would communicate again (and must match on every rank).
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # Context parallelism's K/V gather and balance-statistic sums (torchtitan_lite/mesh/sequence_collectives.py).
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
})


def _op_policy(counts: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in MATMUL_OPS:
            # Forward and recompute passes count separately so both make the same decisions.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in ALWAYS_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_op_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_op_policy(defaultdict(int)))


def _save_attention_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_attention_only)


def _cache_hash(context_fn: Callable[[], tuple[Any, Any]], saves: frozenset) -> str:
    """The ``cache_hash`` torch's AOT-autograd cache asks of a checkpoint context_fn (dynamo accepts only plain
    functions, so it is an attribute): without it every compiled checkpointed block bypasses that cache, and
    each run re-traces and re-partitions the block's forward and backward although inductor's cache holds its
    kernels. What the policy saves decides the graphs; the rule around it is in the function's name."""
    return f"torchtitan_lite.{context_fn.__name__}:" + ",".join(sorted(str(op) for op in saves))


_selective_op_context.cache_hash = _cache_hash(  # type: ignore[attr-defined]
    _selective_op_context, MATMUL_OPS | ALWAYS_SAVED_OPS)
_save_attention_context.cache_hash = _cache_hash(_save_attention_context, ATTENTION_OPS)  # type: ignore[attr-defined]


def apply_ac(blocks: nn.ModuleDict, mode: str, selective_option: str = "op", *, compiled_tp: bool = False) -> str:
    """Wrap the model's ``blocks`` (its ParallelPlan.blocks container) in place; returns a short description for logs.

    mode: 'none' | 'full' | 'selective'. With 'selective', selective_option is 'op' (per-op policy above)
    or an integer N (checkpoint blocks N-1, 2N-1, ... fully; N=1 is 'full').
    compiled_tp: the blocks will be tensor-parallel and compiled. Full checkpointing then keeps the
    attention outputs: torch 2.13 cannot recompute attention in a compiled tensor-parallel block (the
    partitioner tries to save the DeviceMesh for backward).
    """
    if mode == "none":
        return "none"
    full: Callable[[nn.Module], nn.Module] = partial(_full, save_attention=compiled_tp)
    full_what = "full, attention saved" if compiled_tp else "full"
    if mode == "full":
        wrap, every, what = full, 1, full_what
    elif mode == "selective":
        if selective_option == "op":
            wrap, every, what = _per_op, 1, "selective op"
        else:
            every = _parse_every(selective_option)
            wrap, what = full, f"selective every {every} block(s), {full_what}"
    else:
        raise ValueError(f"activation_checkpoint.mode={mode!r} must be 'none', 'full' or 'selective'")
    wrapped = 0
    for position, (name, block) in enumerate(list(blocks.items())):
        if (position + 1) % every == 0:
            blocks.register_module(name, wrap(block))
            wrapped += 1
    description = f"{what} ({wrapped}/{len(blocks)} blocks)"
    logger.info("activation checkpointing: %s", description)
    return description


def _parse_every(option: str) -> int:
    try:
        every = int(option)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(
            f"activation_checkpoint.selective_option={option!r} must be 'op' or a positive integer N "
            "(checkpoint every Nth block)"
        )
    return every


def _save_attention_only(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _full(block: nn.Module, save_attention: bool) -> nn.Module:
    # No dropout in the model, so RNG state need not be stashed and restored.
    if not save_attention:
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_save_attention_context)


def _per_op(block: nn.Module) -> nn.Module:
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_op_context)

