"""Apply the parallelisms to a Llama 3 model built on the meta device, in the one order that composes:

TP (float8 styles for tensorwise float8 blocks, sequence parallel, loss parallel) -> activation
checkpointing -> torch.compile per block -> FSDP2 / HSDP. TP must see the plain Linears to swap in DTensor
parameters; checkpointing wraps the TP'd block; compile traces the checkpointed block; FSDP goes last so
its all-gather / reduce-scatter hooks sit outside the compiled graphs.
"""
from __future__ import annotations

import logging

from torch import nn

from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.compile import apply_compile
from torchtitan_lite.distributed.fsdp import apply_fsdp
from torchtitan_lite.distributed.tensor_parallel import apply_tp, loss_parallel_enabled

logger = logging.getLogger(__name__)


def parallelize_llama(model: nn.Module, parallel_dims, config, *, precision) -> nn.Module:
    """Parallelize `model` in place for `parallel_dims` (meshes built) per the root `config`; returns it.

    `precision.mp_policy()` gives FSDP's MixedPrecisionPolicy. Without data parallelism no FSDP is applied
    (the precision component then casts through autocast instead).
    """
    par = config.parallelism
    layouts = [parallel_dims.describe()]

    if parallel_dims.tp_enabled:
        float8_blocks = apply_tp(model, parallel_dims.tp_mesh, sequence_parallel=par.enable_sequence_parallel,
                                 loss_parallel=loss_parallel_enabled(parallel_dims, config))
        layouts.append("SP" if par.enable_sequence_parallel else "no SP")
        layouts.append("loss parallel" if loss_parallel_enabled(parallel_dims, config) else "replicated logits")
        if float8_blocks:
            layouts.append(f"float8 TP comms in {float8_blocks} blocks")

    compile_blocks = config.compile.enable and "model" in config.compile.components
    ac = apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_option,
                  compiled_tp=compile_blocks and parallel_dims.tp_enabled)
    layouts.append(f"AC {ac}")

    if apply_compile(model, config.compile):
        layouts.append(f"compiled blocks ({config.compile.backend})")

    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims.fsdp_mesh, mp_policy=precision.mp_policy(),
                   reshard_after_forward=par.fsdp_reshard_after_forward, cpu_offload=par.fsdp_cpu_offload)

    logger.info("parallelized llama3: %s", ", ".join(layouts))
    return model
