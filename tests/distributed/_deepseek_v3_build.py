"""A DeepSeek-V3 model built as a run builds it: on meta, through parallelize with the family's plan (FSDP over
every rank, expert parallelism over ``ep`` of them, full activation checkpointing, float32), then given the
same initial weights on every layout. Shared by the gloo tests of the family."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.deepseek_v3.parallelize import DEEPSEEK_V3_PARALLEL_PLAN
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.parallelize import ParallelizeContext


def build_parallel_deepseek_v3(args: DeepSeekV3ModelArgs, world_size: int, initial: dict[str, torch.Tensor], *,
                               ep: int = 1) -> tuple[DeepSeekV3Model, ParallelDims]:
    dims = ParallelDims(1, world_size, 1, world_size=world_size, ep=ep)
    dims.build_mesh("cpu")
    precision = Precision.Config(param_dtype="float32").build(device="cpu", fsdp_enabled=True)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    parallelize(model, DEEPSEEK_V3_PARALLEL_PLAN, ParallelizeContext(
        parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=False, loss_parallel=False,
        activation_checkpoint=ActivationCheckpointConfig(mode="full"), compile_model=False,
        compile_backend="inductor", compile_fullgraph=True, fsdp_reshard_after_forward="default",
        fsdp_cpu_offload=False), label="deepseek_v3")
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True))
    return model, dims
