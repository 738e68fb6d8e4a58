"""A family-agnostic Mixture-of-Experts feed-forward layer: router -> dispatch -> grouped experts -> combine
(+ optional shared experts), with both load-balancing schemes.

Replaceable parts, so that later work plugs in without touching this module:
  * ``experts.grouped_mm`` (models/common/moe/experts.py): the GEMM a low-precision converter swaps;
  * ``dispatcher`` (models/common/moe/dispatch.py): local sort/unsort, or the all-to-all over an expert-parallel
    group (models/common/moe/all_to_all_dispatch.py) that a family's parallelize swaps in with the expert slice;
  * the balancing state is two buffers: ``expert_bias`` (persistent: it checkpoints and, being [E],
    reshards with the experts) and ``tokens_per_expert`` (this step's loads, zeroed by the update);
  * what the router metrics read (models/common/moe/router_stats.py) is kept apart, so reading it never disturbs
    the bias update: ``routed_tokens`` (loads of every training forward since the previous read) and
    ``aux_loss_window`` (summed balance loss and forwards since then).

The balance loss never leaves the layer: a training forward attaches its gradient to the layer's output
(models/common/moe/aux_loss_grad.py), weighted by the ``aux_loss_scale`` buffer, so that it works alike with and
without a pipeline schedule. What the trainer calls (see ``models/common/moe/hooks.py`` for the model-wide forms):
  * ``aux_loss_scale.fill_(s)`` once per step: the balance loss's weight in the objective (1 until set);
  * ``update_expert_bias()`` once after each optimizer step that changed the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.common.feed_forward import FeedForward
from models.common.moe.all_to_all_dispatch import AllToAllTokenDispatcher
from models.common.moe.aux_loss_grad import attach_aux_loss
from models.common.moe.dispatch import LocalTokenDispatcher, TokenDispatcher, tokens_per_expert
from models.common.moe.expert_parallel import shard_experts
from models.common.moe.experts import GroupedExperts
from models.common.moe.load_balance import expert_bias_delta, sequence_aux_loss
from models.common.moe.recompute import recomputing
from models.common.moe.router import SCORE_FUNCS, ScoreFunc, TokenChoiceRouter, check_groups
from torchtitan_lite.protocols.moe_facts import MoEFacts


@dataclass(frozen=True)
class MoEArgs:
    """Shape and behaviour of one MoE layer (a family's model args hold one)."""

    num_experts: int = 8
    """Routed experts per layer."""
    top_k: int = 2
    """Experts each token is sent to."""
    hidden_dim: int = 256
    """SwiGLU width of each routed expert."""
    score_func: ScoreFunc = "softmax"
    """'softmax' over all experts (Qwen3-MoE, Mixtral) or an independent 'sigmoid' per expert (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Rescale the k chosen scores to sum to 1 before combining."""
    route_scale: float = 1.0
    """Multiplies the combine weights (DeepSeek-V3 uses 2.5)."""
    num_groups: int = 1
    """Split the routed experts into this many groups for group-limited routing (DeepSeek-V3: 8); 1: no groups."""
    topk_groups: int = 1
    """Groups each token may pick its experts from, its best by the sum of their two top scores (DeepSeek-V3: 4)."""
    num_shared_experts: int = 0
    """Dense SwiGLU experts every token passes through, of width num_shared_experts * hidden_dim; 0: none."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing: step of the expert-bias update after each optimizer step (DeepSeek-V3: 1e-3);
    0 keeps the bias at zero and stops counting loads."""
    aux_loss_coeff: float = 0.0
    """Weight of the sequence-level balance loss added to the training loss (DeepSeek-V3: 1e-4); 0: off."""
    use_grouped_mm: bool = True
    """Run the experts as torch._grouped_mm GEMMs; False runs the per-expert loop (the reference)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"moe args: {name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"moe args: top_k={self.top_k} must not exceed num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"moe args: score_func={self.score_func!r} must be one of {', '.join(SCORE_FUNCS)}")
        try:
            check_groups(self.num_experts, self.top_k, self.num_groups, self.topk_groups)
        except ValueError as e:
            raise ValueError(f"moe args: {str(e).removeprefix('router ')}") from None
        if self.num_shared_experts < 0:
            raise ValueError(f"moe args: num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.route_scale <= 0:
            raise ValueError(f"moe args: route_scale={self.route_scale} must be positive")
        for name in ("bias_update_rate", "aux_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe args: {name}={getattr(self, name)} must be >= 0 (0 turns it off)")

    def facts(self, layers: tuple[int, ...], experts: str = "moe.experts") -> MoEFacts:
        """These args as the core's MoE facts, for the MoE blocks ``layers`` whose layer sits at ``experts``'
        parent (``MoE.experts`` holds the routed weights)."""
        return MoEFacts(num_experts=self.num_experts, top_k=self.top_k, expert_hidden_dim=self.hidden_dim,
                        shared_hidden_dim=self.num_shared_experts * self.hidden_dim, layers=layers, experts=experts)

    @property
    def active_hidden_dim(self) -> int:
        """SwiGLU width each token passes through: its k routed experts plus the shared ones."""
        return (self.top_k + self.num_shared_experts) * self.hidden_dim


class MoE(nn.Module):
    """x [batch, seq, dim] -> [batch, seq, dim]."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = TokenChoiceRouter(dim, args.num_experts, args.top_k, score_func=args.score_func,
                                        norm_topk_prob=args.norm_topk_prob, route_scale=args.route_scale,
                                        num_groups=args.num_groups, topk_groups=args.topk_groups)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, use_grouped_mm=args.use_grouped_mm)
        self.shared_experts = (FeedForward(dim, args.num_shared_experts * args.hidden_dim)
                               if args.num_shared_experts else None)
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher(args.num_experts)
        # float32 whatever the model's dtype: a bf16 bias could not hold 1e-3 steps on top of scores ~0.5.
        self.expert_bias: torch.Tensor
        self.tokens_per_expert: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)
        # For the metrics, counted whether or not the bias is on. int64: exact over any log interval, and
        # untouched when a model is cast to a low-precision dtype.
        self.routed_tokens: torch.Tensor
        self.aux_loss_window: torch.Tensor
        self.register_buffer("routed_tokens", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_window", torch.zeros(2, dtype=torch.float32), persistent=False)
        # The weight of this layer's balance loss in what backward differentiates (models/common/moe/hooks.py:
        # set_aux_loss_scale): 1 / the forwards over which the step averages it, times the FP16 loss scale. A
        # buffer, not a float attribute: a compiled block reads it as an input and recompiles for no new value.
        self.aux_loss_scale: torch.Tensor
        self.register_buffer("aux_loss_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.cp_group: dist.ProcessGroup | None = None
        """Context parallelism's group: the sequence-level balance loss sums its statistics over it."""

    def use_context_parallel(self, group: dist.ProcessGroup) -> bool:
        """ContextParallelLayer: the balance loss is per sequence, and this rank holds only its chunks of each.
        Not an attention (False): routing is per token and needs nothing else of the other ranks."""
        self.cp_group = group
        return False

    def shard_experts(self, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None) -> None:
        """Expert parallelism (ExpertParallelLayer): the expert weights become DTensors sharded on dim 0 over
        ``ep_mesh`` and the tokens are exchanged over it (models/common/moe/expert_parallel.py). ep_tp_mesh: the
        (ep, tp) mesh, when the experts are already TP-split DTensors on its tp dim (TP applied first)."""
        dispatcher = AllToAllTokenDispatcher(self.args.num_experts, ep_mesh.get_group())  # checks the split first
        shard_experts(self.experts, ep_mesh, ep_tp_mesh)
        self.dispatcher = dispatcher

    def keep_exchanges_for_recompute(self, keep: bool) -> int:
        """ExpertParallelLayer: only the all-to-all dispatcher has exchanges to keep; the local one ignores it."""
        if not isinstance(self.dispatcher, AllToAllTokenDispatcher):
            return 0
        self.dispatcher.save_for_recompute = keep
        return int(keep)

    @property
    def uses_expert_bias(self) -> bool:
        return self.args.bias_update_rate > 0

    def init_weights(self, out_proj_std: float, router_std: float = 0.02) -> None:
        self.router.init_weights(router_std)
        self.experts.init_weights(out_proj_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_proj_std)
        # Buffers too: after to_empty they hold garbage. The dtype is re-asserted for models cast as a whole.
        self.expert_bias = torch.zeros_like(self.expert_bias, dtype=torch.float32)
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert, dtype=torch.float32)
        self.routed_tokens = torch.zeros_like(self.routed_tokens, dtype=torch.int64)
        self.aux_loss_window = torch.zeros_like(self.aux_loss_window, dtype=torch.float32)
        self.aux_loss_scale = torch.ones_like(self.aux_loss_scale, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens, self.expert_bias if self.uses_expert_bias else None)
        aux_loss = None
        if self.training:
            aux_loss = self._record(routing.experts, routing.scores, batch, seq_len, recomputing=recomputing())
        rows, counts, handle = self.dispatcher.dispatch(tokens, routing.experts)
        out = self.dispatcher.combine(self.experts(rows, counts), handle, routing.weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if aux_loss is not None and torch.is_grad_enabled():
            out = attach_aux_loss(out, aux_loss, self.aux_loss_scale)
        return out.view(batch, seq_len, dim)

    def _record(self, experts: torch.Tensor, scores: torch.Tensor, batch: int, seq_len: int, *,
                recomputing: bool) -> torch.Tensor | None:
        """Count the loads of a training forward and return its coefficient-weighted balance loss (None when
        off). An activation-checkpointing recomputation counts nothing (the original forward did) but computes
        the loss again: its backward is the one that reaches the router."""
        if not recomputing:
            with torch.no_grad():
                loads = tokens_per_expert(experts, self.args.num_experts)
                self.routed_tokens.add_(loads)
                if self.uses_expert_bias:
                    self.tokens_per_expert.add_(loads)
        if self.args.aux_loss_coeff <= 0:
            return None
        aux_loss = self.args.aux_loss_coeff * sequence_aux_loss(
            scores.view(batch, seq_len, -1), experts.view(batch, seq_len, -1), self.args.num_experts, self.cp_group)
        if not recomputing:
            with torch.no_grad():  # [sum of the loss, forwards], read by the metrics
                self.aux_loss_window.add_(torch.stack([aux_loss.detach().float(), aux_loss.new_ones(())]))
        return aux_loss

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Move the bias toward balance from the loads counted since the last update, then zero them.

        Call once after each optimizer step that applied (not after one the FP16 scaler or the spike
        policy skipped). ``group``: the data-parallel ranks, whose loads are summed first so that every
        rank applies the same update and the bias stays replicated.
        """
        if not self.uses_expert_bias:
            return
        loads = self.tokens_per_expert
        if group is not None:
            dist.all_reduce(loads, group=group)
        self.expert_bias += expert_bias_delta(loads, self.args.bias_update_rate)
        loads.zero_()

