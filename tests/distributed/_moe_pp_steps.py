"""A tiny Qwen3-MoE trained for a few steps under pipeline parallelism (and FSDP x EP within each stage): the
body of the MoE pipeline tests.

The stages are cut, parallelized and run as the trainer does (build_stage_modules, the family's parallelize
function per stage, PipelineRunner), from the same initial weights as the single-process reference, on the
same global batches, with the trainer's loss semantics: every micro-batch's language-model loss divided by the
global target tokens, the balance loss weighted by the trainer's set_aux_loss_weight (1 / (pipeline
micro-batches x data-parallel ranks)), the grad norm over the pipeline, the expert bias moved after each step from the
loads summed over the data-parallel ranks. The reference runs the whole batch in one forward on one process:
routing is per token and the balance loss a mean over sequences, so only the order of float sums differs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _llama_steps import GLOBAL_BATCH, LR, MAX_NORM, global_batches
from _moe_ep_steps import TINY_MOE
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from models.common.moe.router_stats import named_moe_layers
from models.qwen3_moe.model import Qwen3MoeModel
from torchtitan_lite.aux_loss_weight import set_aux_loss_weight
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.pipeline import build_stage_modules, resolve_pipeline
from torchtitan_lite.distributed.pipeline.runner import PipelineRunner
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.protocols.parallelize import ParallelizeContext

# TINY_MOE (4 experts, top-2, both balancing schemes, balance-loss coefficient 1e-2) with 4 blocks: two stages
# per rank for the looped schedules at pp 2.
ARGS = dataclasses.replace(TINY_MOE, n_layers=4)


@dataclass(frozen=True)
class PPRun:
    pp: int = 1
    dp_shard: int = 1
    ep: int = 1
    schedule: str = "1F1B"
    ac_mode: str = "none"
    microbatch_size: int = 1
    steps: int = 8
    aux_weight: float = 1.0
    """Negative control: the balance loss weighted this many times what the trainer weights it."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_shard


def initial_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Qwen3MoeModel(ARGS)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


def build(run: PPRun):
    """(parts, dims, runner or None): this rank's stages, parallelized and holding the initial weights."""
    dims = ParallelDims(1, run.dp_shard, 1, world_size=run.world_size, ep=run.ep, pp=run.pp)
    dims.build_mesh("cpu")
    precision = Precision.Config(param_dtype="float32").build(device="cpu", fsdp_enabled=dims.fsdp_enabled)
    with torch.device("meta"):
        model = Qwen3MoeModel(ARGS)
    layout = resolve_pipeline(pp=run.pp, schedule=run.schedule, stages_per_rank=0, microbatch_size=run.microbatch_size,
                              split_points=[], layers_per_stage=0, n_layers=ARGS.n_layers,
                              local_batch_size=GLOBAL_BATCH // dims.dp_degree,
                              blocks=get_model_spec("qwen3_moe").parallel_plan.blocks)
    stage_ids = layout.stage_ids(dims.pp_rank) if layout is not None else ()
    plan = get_model_spec("qwen3_moe").parallel_plan
    parts = build_stage_modules(model, plan, layout, stage_ids) if layout is not None else [model]
    initial = initial_state_dict()
    for part in parts:
        parallelize(part, plan, ParallelizeContext(
            parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=False, loss_parallel=False,
            activation_checkpoint=ActivationCheckpointConfig(mode=run.ac_mode), compile_model=False,
            compile_backend="inductor", compile_fullgraph=True,
            fsdp_reshard_after_forward="never" if layout is not None else "default", fsdp_cpu_offload=False),
            label="qwen3_moe")
        part.to_empty(device="cpu")
        part.init_weights()
        own = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: v for k, v in initial.items() if k in own},
                             options=StateDictOptions(full_state_dict=True))
        part.train()
    runner = None
    if layout is not None:
        runner = PipelineRunner(layout, parts, stage_ids, group=dims.pp_mesh.get_group(), device=torch.device("cpu"),
                                loss_fn=cross_entropy_sum)
    return parts, dims, runner


def train(rank: int, world_size: int, run: PPRun) -> dict:
    """Per-step global losses and grad norms, every layer's final expert bias (of this rank's stages), the
    router statistics of the run (this rank's stages)."""
    parts, dims, runner = build(run)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    dp_group = dims.dp_mesh.get_group() if dims.dp_mesh is not None else None
    pp_group = dims.pp_mesh.get_group() if dims.pp_mesh is not None else None
    rows = GLOBAL_BATCH // dims.dp_degree
    out: dict = {"losses": [], "grad_norms": [], "dp_rank": dims.dp_rank}
    for global_inputs, global_labels in global_batches(run.steps):
        global_tokens = (global_labels != IGNORE_INDEX).sum().float()
        inputs, labels = (t[dims.dp_rank * rows:(dims.dp_rank + 1) * rows] for t in (global_inputs, global_labels))
        weight = set_aux_loss_weight(parts, n_batches=1, forwards_per_batch=runner.forwards_per_batch if runner else 1,
                                     parallel_dims=dims)
        if run.aux_weight != 1.0:
            for part in parts:
                part.set_aux_loss_scale(run.aux_weight * weight)
        if runner is not None:
            loss = runner.step(inputs, labels, global_tokens=global_tokens)
            dist.all_reduce(loss, group=pp_group)
        else:
            loss_sum, _ = cross_entropy_sum(parts[0](inputs), labels)
            loss = loss_sum / global_tokens
            loss.backward()
            loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
        if "router_grads" not in out:
            out["router_grads"] = router_grads(parts)
        out["grad_norms"].append(float(clip_grad_norm_(params, MAX_NORM, pp_mesh=dims.pp_mesh)))
        optimizer.step()
        optimizer.zero_grad()
        for part in parts:
            part.post_optimizer_step(dp_group)
        out["losses"].append(float(loss))
    out["bias"] = {name: layer.expert_bias.clone() for part in parts for name, layer in named_moe_layers(part)}
    out["router_stats"] = [{k: float(v) for k, v in part.training_stats(dp_group).items()} for part in parts]
    return out


def router_grads(parts) -> dict[str, torch.Tensor]:
    """Every router gate's full gradient (the balance loss reaches the routers only), by its model name."""
    grads = {}
    for part in parts:
        for name, param in part.named_parameters():
            if name.endswith("router.gate.weight"):
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                grads[name.replace("_checkpoint_wrapped_module.", "")] = grad.detach().clone()
    return grads


def train_runs(rank: int, world_size: int, runs: list[PPRun]) -> list[dict]:
    return [train(rank, world_size, run) for run in runs]
