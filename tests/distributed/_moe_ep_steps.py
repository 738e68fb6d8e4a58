"""A tiny Qwen3-MoE trained for a few steps under a data / expert-parallel layout: the shared body of the
expert-parallelism tests.

Every layout trains from the same initial weights (made on one process, then loaded into the parallel model) on the
same global batches with the trainer's loss semantics: each rank sums the token losses of its share of the global
batch and divides by the target tokens of the whole batch, weights its balance loss by 1 / the number of shares
(through the trainer's set_aux_loss_weight), and FSDP sums gradients over the data-parallel ranks; the expert bias
moves after each step from the loads summed over the data-parallel ranks. The single-process reference runs the
shares of each global batch in turn (``Run.single_process``), so it computes what the ranks compute and only the
order of float sums differs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _llama_steps import GLOBAL_BATCH, LR, MAX_NORM, global_batches
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from models.common.moe.all_to_all_dispatch import AllToAllTokenDispatcher, _exchange
from models.common.moe.hooks import moe_layers
from models.common.moe.layer import MoEArgs
from models.qwen3_moe.args import Qwen3MoeModelArgs
from models.qwen3_moe.model import Qwen3MoeModel
from models.qwen3_moe.parallelize import QWEN3_MOE_PARALLEL_PLAN
from torchtitan_lite.aux_loss_weight import set_aux_loss_weight
from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig, CompileConfig
from torchtitan_lite.distributed.compile import apply_compile
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.parallelize import ParallelizeContext

# 4 experts (split 2 / 2 under EP 2, 1 / 1 / 1 / 1 under EP 4), top-2, both balancing schemes on so that the
# bias update and the balance loss are part of what must match. Dims are multiples of 16 (grouped_mm).
TINY_MOE = Qwen3MoeModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256,
                             max_seq_len=64, rope_theta=10000.0,
                             moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=32, bias_update_rate=1e-3,
                                         aux_loss_coeff=1e-2))


@dataclass(frozen=True)
class Run:
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    param_dtype: str = "float32"
    ac_mode: str = "none"
    ac_option: str = "op"
    compile: bool = False
    steps: int = 20
    shares: int = 1
    """On one process: the global batch in this many data-parallel shares in turn (the reference)."""
    one_rank_fsdp: bool = False
    """On one process: FSDP on a one-rank mesh, for data parallelism's parameter casts (low precision)."""
    drop_remote_tokens: bool = False
    """Negative control: the all-to-all dispatcher drops the tokens routed to another rank's experts."""
    compile_ep_regions: bool = False
    """With compile on one process: compile what expert parallelism compiles (QWEN3_MOE_PARALLEL_PLAN.ep_compile_regions), not whole
    blocks, so that inductor's fusions, which change bf16 roundings, are the same as the EP run's."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def single_process(self) -> Run:
        return dataclasses.replace(self, dp_replicate=1, dp_shard=1, ep=1, shares=self.world_size * self.shares,
                                   one_rank_fsdp=self.param_dtype != "float32", drop_remote_tokens=False,
                                   compile_ep_regions=self.compile and self.ep > 1)


class _OneRankFsdp(ParallelDims):
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        self._one_rank = init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard",))
        return None

    @property
    def fsdp_enabled(self) -> bool:
        return True

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        return self._one_rank


class _DroppingDispatcher(AllToAllTokenDispatcher):
    """Negative control: rows computed by another rank's experts come back as zeros."""

    def combine(self, y, handle, weights):
        arrival_order = torch.empty_like(y).index_copy_(0, handle.regroup, y)
        returned = _exchange(arrival_order, handle.send_splits, handle.recv_splits, self.group)
        me = dist.get_rank(self.group)
        keep = torch.repeat_interleave(torch.tensor([float(r == me) for r in range(self.ep)]),
                                       torch.tensor(handle.send_splits))
        return self._local.combine(returned * keep[:, None].to(returned.dtype), handle.local, weights)


def initial_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Qwen3MoeModel(TINY_MOE)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


def build(run: Run, *, load_initial: bool = True):
    dims_cls = _OneRankFsdp if run.one_rank_fsdp else ParallelDims
    dims = dims_cls(run.dp_replicate, run.dp_shard, 1, world_size=run.world_size, ep=run.ep)
    dims.build_mesh("cpu")
    precision = Precision.Config(param_dtype=run.param_dtype).build(device="cpu", fsdp_enabled=dims.fsdp_enabled)
    with torch.device("meta"):
        model = Qwen3MoeModel(TINY_MOE)
    compile_config = CompileConfig()  # the default backend and fullgraph
    # Regions are compiled below, outside parallelize: parallelize then leaves the blocks uncompiled.
    compile_blocks = run.compile and not run.compile_ep_regions
    parallelize(model, QWEN3_MOE_PARALLEL_PLAN, ParallelizeContext(
        parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=False, loss_parallel=False,
        activation_checkpoint=ActivationCheckpointConfig(mode=run.ac_mode, selective_option=run.ac_option),
        compile_model=compile_blocks, compile_backend=compile_config.backend,
        compile_fullgraph=compile_config.fullgraph,
        fsdp_reshard_after_forward="default", fsdp_cpu_offload=False), label="qwen3_moe")
    if run.compile_ep_regions:
        apply_compile(model.layers, backend=compile_config.backend, fullgraph=compile_config.fullgraph,
                      regions=QWEN3_MOE_PARALLEL_PLAN.ep_compile_regions)
    if run.drop_remote_tokens:
        for moe in moe_layers(model):
            moe.dispatcher = _DroppingDispatcher(TINY_MOE.moe.num_experts, dims.ep_mesh.get_group())
    model.to_empty(device="cpu")
    model.init_weights()
    if load_initial:
        set_model_state_dict(model, initial_state_dict(), options=StateDictOptions(full_state_dict=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, dims, precision, optimizer


def train(run: Run, model, dims: ParallelDims, precision: Precision, optimizer, *, first: int = 0,
          steps: int | None = None, keep_first_grads: bool = False) -> dict:
    """Train global batches first..first+steps-1; per-step global losses, grad norms and layer 0's bias."""
    shares = dims.dp_degree * run.shares
    rows = GLOBAL_BATCH // shares
    first_share = dims.dp_rank * run.shares
    dp_group = dims.dp_mesh.get_group() if dims.dp_mesh is not None else None
    out: dict = {"losses": [], "grad_norms": [], "bias": []}
    batches = global_batches(first + (run.steps if steps is None else steps))[first:]
    for step, (global_inputs, global_labels) in enumerate(batches, start=first):
        global_tokens = (global_labels != IGNORE_INDEX).sum().float()
        total = torch.zeros(())
        set_aux_loss_weight([model], n_batches=run.shares, forwards_per_batch=1, parallel_dims=dims)  # 1 / shares
        for share in range(first_share, first_share + run.shares):
            inputs, labels = (t[share * rows:(share + 1) * rows] for t in (global_inputs, global_labels))
            with precision.autocast():
                loss_sum, _ = cross_entropy_sum(model(inputs), labels)
                loss = loss_sum / global_tokens
                loss.backward()  # with each MoE layer's balance loss, weighted 1 / shares
            total += loss.detach().float()
        if keep_first_grads and step == 0:
            out["first_grads"] = full_grads(model)
        out["grad_norms"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        model.post_optimizer_step(dp_group)
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        out["losses"].append(float(total))
        out["bias"].append(model.layers["0"].moe.expert_bias.clone())
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return grads


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer, unsharded (on every rank)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def run_layout(rank: int, world_size: int, run: Run, **train_kwargs) -> dict:
    model, dims, precision, optimizer = build(run)
    return train(run, model, dims, precision, optimizer, **train_kwargs)


def train_runs(rank: int, world_size: int, runs: list[Run], **train_kwargs) -> list[dict]:
    return [run_layout(rank, world_size, run, **train_kwargs) for run in runs]


def run_single(run: Run, **train_kwargs) -> dict:
    """The single-process reference of ``run`` (in one spawned gloo process)."""
    from _harness import run_ranks

    return run_ranks(run_layout, 1, run.single_process(), **train_kwargs)[0]


# ---------------------------------------------------------------------------------------------------
# Checkpoints


class _Optim:
    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def _checkpointer(model, optimizer, folder: str):
    states = {"model": ModelWrapper(model), "optimizer": _Optim(model, optimizer)}
    return CheckpointManager.Config(enable=True, interval=1).build(dump_folder=folder, states=states)


def save_after(rank: int, world_size: int, run: Run, folder: str, steps: int) -> dict:
    """Train ``steps`` steps of ``run``, save model + optimizer, and return the full state and what the
    next two steps give."""
    model, dims, precision, optimizer = build(run)
    train(run, model, dims, precision, optimizer, steps=steps)
    ckpt = _checkpointer(model, optimizer, folder)
    ckpt.save(steps, force=True)
    ckpt.close()
    state = full_state(model)
    return {"state": state, "next": train(run, model, dims, precision, optimizer, first=steps, steps=2)}


def load_and_continue(rank: int, world_size: int, run: Run, folder: str, steps: int) -> dict:
    """Build ``run`` from other initial weights, load the checkpoint saved after ``steps`` steps; the full state
    and the next two steps."""
    torch.manual_seed(rank + 7)
    model, dims, precision, optimizer = build(run, load_initial=False)
    ckpt = _checkpointer(model, optimizer, folder)
    assert ckpt.load() == steps
    state = full_state(model)
    return {"state": state, "next": train(run, model, dims, precision, optimizer, first=steps, steps=2)}




def collectives_of_one_step(rank: int, world_size: int, run: Run) -> dict[str, list[str]]:
    """The collectives (op names) of the first step's forward and of its backward, separately."""
    from _collectives import CollectiveLog

    model, dims, precision, _ = build(run)
    inputs, labels = (t[rank * 2:(rank + 1) * 2] for t in global_batches(1)[0])
    with CollectiveLog() as forward:
        loss_sum, _ = cross_entropy_sum(model(inputs), labels)
    with CollectiveLog() as backward:
        loss_sum.backward()
    return {"forward": [c.op for c in forward.calls], "backward": [c.op for c in backward.calls]}
