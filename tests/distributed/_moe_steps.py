"""A tiny Qwen3-MoE trained for a few steps under a given layout: the body of the MoE tensor-parallel tests.

As _llama_steps (whose Run, batches, tolerances and reference rules it reuses): every layout trains from the same
initial weights on the same global batches with the training loop's loss semantics, so every layout must reproduce
the single-process losses. On top of the language-model loss each step adds the MoE layers' balance loss (its share
of the global mean, weighted by the trainer's set_aux_loss_weight) and, after the optimizer step, updates the
expert bias from the loads summed over the data-parallel ranks only (``post_optimizer_step(dp_group)``): the
tensor-parallel ranks route the same gathered tokens, so a correct layout leaves every bias as the single
process's.

The tiny model has one shared expert, which no published Qwen3-MoE flavor has, so that the shared experts'
split is trained too. ``MoERun.ep`` adds expert parallelism to a layout (EP x TP). ``Run.model`` picks the
family (MOE_MODELS): the tiny Qwen3-MoE, or a tiny DeepSeek-V3 (latent attention with low-rank or full-rank
queries, one dense block then MoE blocks).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _llama_steps import MAX_NORM, Run, _OneRankFsdp, blockwise_converter, full_grads, global_batches, parallel_config
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from models.common.attention.yarn import YarnScaling
from models.common.moe.layer import MoEArgs
from models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from models.deepseek_v3.parallelize import DEEPSEEK_V3_PARALLEL_PLAN
from models.qwen3_moe import Qwen3MoeModel, Qwen3MoeModelArgs
from models.qwen3_moe.parallelize import QWEN3_MOE_PARALLEL_PLAN
from torchtitan_lite.aux_loss_weight import set_aux_loss_weight
from torchtitan_lite.compat import float8_recipe_needs_emulation
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.tensor_parallel import local_loss, loss_parallel_context
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.protocols.parallelize import ParallelizeContext

# Vocabulary as _llama_steps' batches; attention Linears multiples of 16 (float8); heads, KV heads and the
# experts' hidden dim split over tp=2 (32 / 2 = 16 channels per rank, a multiple of 8 for torch._grouped_mm).
TINY_MOE = Qwen3MoeModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, max_seq_len=64, rope_theta=10000.0,
    moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=32, num_shared_experts=1, aux_loss_coeff=1e-2,
                bias_update_rate=1e-3),
)
# Latent attention split over tp=2 (4 heads), with YaRN, group-limited sigmoid routing (top-2 of 8 experts in the 2
# best of 4 groups: with 4 experts in 2 groups every token took both experts of a group and the bias update
# stepped back to zero) and a shared expert; block 0 dense (its SwiGLU split as Llama 3's), block 1 MoE.
TINY_DEEPSEEK_V3 = DeepSeekV3ModelArgs(
    dim=64, n_layers=2, n_heads=4, vocab_size=256, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_dense_layers=1, dense_hidden_dim=128, norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16), max_seq_len=64,
    moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func="sigmoid", norm_topk_prob=True, route_scale=2.5,
                num_groups=4, topk_groups=2, num_shared_experts=1, bias_update_rate=1e-3, aux_loss_coeff=1e-2),
)
# The blockwise FP8 recipe under TP 2: every converted Linear's TP shard holds whole 128-wide tiles and blocks
# (2 heads of qk head dim 128 + 128 and v head dim 128: wq_b / wkv_b 256 rows, wo 128 columns per rank; the
# replicated wq_a 256 -> 128 and wkv_a 256 -> 128 + 128 whole; SwiGLU and shared-expert hidden dims 256 per rank).
TINY_DEEPSEEK_V3_128 = dataclasses.replace(
    TINY_DEEPSEEK_V3, dim=256, n_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128,
    qk_rope_head_dim=128, v_head_dim=128, dense_hidden_dim=512,
    moe=dataclasses.replace(TINY_DEEPSEEK_V3.moe, hidden_dim=256),
)


@dataclass(frozen=True)
class MoEModel:
    model_cls: type[BaseModel]
    args: Any
    plan: ParallelPlan
    label: str


MOE_MODELS: dict[str, MoEModel] = {
    "tiny": MoEModel(Qwen3MoeModel, TINY_MOE, QWEN3_MOE_PARALLEL_PLAN, "qwen3_moe"),
    "deepseek_v3": MoEModel(DeepSeekV3Model, TINY_DEEPSEEK_V3, DEEPSEEK_V3_PARALLEL_PLAN, "deepseek_v3"),
    # Full-rank queries (wq column-parallel on the gathered input, as the 16B flavor).
    "deepseek_v3_full_rank_q": MoEModel(DeepSeekV3Model, dataclasses.replace(TINY_DEEPSEEK_V3, q_lora_rank=0),
                                        DEEPSEEK_V3_PARALLEL_PLAN, "deepseek_v3"),
    "deepseek_v3_128": MoEModel(DeepSeekV3Model, TINY_DEEPSEEK_V3_128, DEEPSEEK_V3_PARALLEL_PLAN, "deepseek_v3"),
}
LR = 3e-3


@dataclass(frozen=True)
class MoERun(Run):
    ep: int = 1
    """parallelism.ep: experts split over this many of the dp_shard ranks (composed with tp)."""

    def single_process(self) -> Run:
        # The reference of an EP layout is its data-parallel shares in turn, as without EP.
        return dataclasses.replace(super().single_process(), ep=1)


def initial_state_dict(name: str = "tiny") -> dict[str, torch.Tensor]:
    family = MOE_MODELS[name]
    torch.manual_seed(0)
    model = family.model_cls(family.args)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


def build(run: Run) -> tuple[BaseModel, ParallelDims, Precision, object]:
    """Meta model -> float8 conversion of the attention -> the family's parallelize -> materialise -> initial
    weights."""
    family = MOE_MODELS[run.model]
    one_rank_fsdp = run.world_size == 1 and run.dp_micro_batches > 1
    dims = (_OneRankFsdp if one_rank_fsdp else ParallelDims)(run.dp_replicate, run.dp_shard, run.tp,
                                                              world_size=run.world_size, ep=getattr(run, "ep", 1))
    dims.build_mesh("cpu")
    config = parallel_config(run, dims)
    precision = Precision.Config(param_dtype=run.param_dtype).build(device="cpu", fsdp_enabled=dims.fsdp_enabled)
    with torch.device("meta"):
        model = family.model_cls(family.args)
    if run.float8:
        fp8_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(run.float8),
                                         emulate=float8_recipe_needs_emulation(run.float8, "cpu") is not None)
        # The attention Linears only: the router and the experts are not Linears the float8 converter owns.
        convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda m, fqn: ".attention." in fqn)
    if run.blockwise:
        blockwise_converter(run, dims, family.plan).convert(model)
    parallelize(model, family.plan, ParallelizeContext(
        parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=config.sequence_parallel,
        loss_parallel=config.loss_parallel, activation_checkpoint=config.activation_checkpoint,
        compile_model=config.compile_model, compile_backend=config.compile_backend,
        compile_fullgraph=config.compile_fullgraph,
        fsdp_reshard_after_forward=run.reshard_after_forward, fsdp_cpu_offload=False), label=family.label)
    model.to_empty(device="cpu")
    model.init_weights()
    if dims.fsdp_enabled or dims.tp_enabled:
        set_model_state_dict(model, initial_state_dict(run.model), options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(initial_state_dict(run.model))
    return model, dims, precision, config


def optimizer_for(model: BaseModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train(run: Run, model: BaseModel, dims: ParallelDims, precision: Precision, config) -> dict:
    """Train ``run.steps`` steps; per-step global losses and grad norms, the first gradients, every layer's
    final expert bias and the router statistics of the whole run."""
    optimizer = optimizer_for(model)
    out: dict = {"losses": [], "grad_norms": []}
    for step, batch in enumerate(global_batches(run.steps)):
        keep = (lambda: out.update(first_grads=full_grads(model))) if step == 0 else (lambda: None)
        loss, grad_norm = train_step(run, model, optimizer, dims, precision, config, batch, on_grads=keep)
        out["losses"].append(loss)
        out["grad_norms"].append(grad_norm)
    out["bias"] = expert_biases(model)
    out["router_stats"] = {k: float(v) for k, v in model.training_stats(_dp_group(dims)).items()}
    return out


def train_step(run: Run, model: BaseModel, optimizer: torch.optim.Optimizer, dims: ParallelDims,
               precision: Precision, config, batch: tuple[torch.Tensor, torch.Tensor],
               on_grads: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """One step on the global ``batch`` (this rank's shares of it): (global loss, gradient norm)."""
    global_inputs, global_labels = batch
    dp_group = _dp_group(dims)
    shares = dims.dp_degree * run.dp_micro_batches
    rows = global_inputs.shape[0] // shares
    first_share = dims.dp_rank * run.dp_micro_batches
    global_tokens = (global_labels != IGNORE_INDEX).sum().float()
    share_losses = []
    set_aux_loss_weight([model], n_batches=run.dp_micro_batches, forwards_per_batch=1, parallel_dims=dims)  # 1 / shares
    for share in range(first_share, first_share + run.dp_micro_batches):
        inputs = global_inputs[share * rows:(share + 1) * rows]
        labels = global_labels[share * rows:(share + 1) * rows]
        with precision.autocast(), loss_parallel_context(config.loss_parallel):
            loss_sum, _ = cross_entropy_sum(model(inputs), labels)
            loss = loss_sum / global_tokens
            loss.backward()  # with each MoE layer's balance loss, weighted 1 / shares
        share_losses.append(loss.detach())
    on_grads()
    grad_norm = float(clip_grad_norm_(model.parameters(), MAX_NORM))
    optimizer.step()
    optimizer.zero_grad()
    model.post_optimizer_step(dp_group)
    value = sum(local_loss(loss) for loss in share_losses).clone()
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
    return float(value), grad_norm


def expert_biases(model: BaseModel) -> dict[str, torch.Tensor]:
    return {name: layer.moe.expert_bias.clone() for name, layer in model.layers.items() if hasattr(layer, "moe")}


def _dp_group(dims: ParallelDims) -> dist.ProcessGroup | None:
    return dims.dp_mesh.get_group() if dims.dp_mesh is not None else None


def run_layout(rank: int, world_size: int, run: Run) -> dict:
    """Worker: build and train ``run`` on this rank."""
    return train(run, *build(run))


def train_runs(rank: int, world_size: int, runs: list[Run]) -> list[dict]:
    """Worker: each run in turn in one process group."""
    return [run_layout(rank, world_size, run) for run in runs]


def run_single(run: Run) -> dict:
    """The single-process reference of ``run`` (one spawned gloo process where it needs FSDP's one-rank mesh)."""
    run = run.single_process()
    if run.dp_micro_batches > 1:
        from _harness import run_ranks

        return run_ranks(run_layout, 1, run)[0]
    return train(run, *build(run))


def assert_same_routing(ranks: list[dict], ref: dict) -> None:
    """Every rank routed as the single process did: the same expert biases (updated from token counts summed
    over the data ranks only) and the same loads per expert."""
    for got in ranks:
        assert set(got["bias"]) == set(ref["bias"])
        for layer, bias in ref["bias"].items():
            assert torch.equal(got["bias"][layer], bias), (layer, got["bias"][layer], bias)
        stats, ref_stats = got["router_stats"], ref["router_stats"]
        assert set(stats) == set(ref_stats)
        for tag in ref_stats:
            if tag == "moe/aux_loss":
                assert stats[tag] == pytest.approx(ref_stats[tag], rel=1e-5)
            else:  # count-based: exact
                assert stats[tag] == ref_stats[tag], tag
    assert any(float(b.abs().max()) > 0 for b in ref["bias"].values())  # the bias did move


# --- checkpoints: saved under a layout, loaded elsewhere ----------------------------------------------

SAVED_STEPS = 2


class _OptimizerState:
    """The optimizer's state in DCP form (sharded like the parameters it belongs to)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def states(model, optimizer) -> dict:
    from torchtitan_lite.components.checkpoint import ModelWrapper

    return {"model": ModelWrapper(model), "optimizer": _OptimizerState(model, optimizer)}


def checkpointer(dump: str, states: dict):
    from torchtitan_lite.components.checkpoint import CheckpointManager

    return CheckpointManager.Config(enable=True, interval=SAVED_STEPS).build(dump_folder=dump, states=states)


def train_save_continue(rank: int, world_size: int, dump: str, run: Run) -> tuple[list[float], dict, dict]:
    """Train SAVED_STEPS steps of ``run``, save, train two more: (the two losses after the save, saved biases,
    the saved model state unsharded)."""
    model, dims, precision, config = build(run)
    optimizer = optimizer_for(model)
    ckpt = checkpointer(dump, states(model, optimizer))
    batches = global_batches(SAVED_STEPS + 2)
    for step in range(SAVED_STEPS):
        train_step(run, model, optimizer, dims, precision, config, batches[step])
    ckpt.save(SAVED_STEPS)
    ckpt.close()
    saved_bias = expert_biases(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    saved_state = {k: v.clone() for k, v in full.items()}  # plain buffers come back as themselves: copy now
    after = [train_step(run, model, optimizer, dims, precision, config, batches[step])[0]
             for step in range(SAVED_STEPS, SAVED_STEPS + 2)]
    return after, saved_bias, saved_state
