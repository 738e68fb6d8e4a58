"""Total and active parameters of a model, and its training FLOPs per token, from its MoE facts and its shape.

A token uses every parameter but the routed experts it is not sent to: of each MoE layer's routed experts
it uses top_k / num_experts (its k experts; shared experts are dense and always used). So

    active = total - sum over MoE layers of (num_experts - top_k) / num_experts x routed expert parameters

and a dense model (no facts) has active == total. The training FLOPs per token are the PaLM / torchtitan
estimate on the active parameters (what MFU must count, or an MoE run would report its idle experts as
work):

    6 x (active - embedding lookup) + 6 x n_layers x n_heads x (head_dim + v_head_dim) x seq_len

2 FLOPs per multiply-add in forward, twice that in backward; the embedding is a lookup (a tied matrix is
also the output projection, so it counts); the second term is the attention scores (over head_dim channels)
and their weighted sum of the values (v_head_dim channels) over the full score matrix, not its causal half.
With v_head_dim == head_dim it is torchtitan's 12 x n_layers x n_heads x head_dim x seq_len; latent attention
(DeepSeek-V3) has narrower values than its query/key heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchtitan_lite.protocols.model_shape import ModelShape
from torchtitan_lite.protocols.moe_facts import MoEFacts


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Every parameter, a tied matrix once."""
    active: int
    """Parameters one token uses (total for a dense model)."""
    routed_experts: int
    """Parameters of the routed experts, all layers (0 for a dense model)."""
    embedding_lookup: int
    """The embedding matrix when it is only looked up (untied); 0 when it is also the output projection."""

    @property
    def active_matmul(self) -> int:
        """Active parameters that take part in a matmul for each token."""
        return self.active - self.embedding_lookup

    def describe(self) -> str:
        if self.active == self.total:
            return f"{self.total:,} parameters"
        return (f"{self.total:,} parameters, {self.active:,} active per token "
                f"({self.active / self.total:.1%}; routed experts {self.routed_experts:,})")


def param_counts(model: nn.Module, facts: MoEFacts | None, *, blocks: str, embedding: str) -> ParamCounts:
    """Count ``model``'s parameters (global sizes: works on meta and on DTensor-sharded models). ``blocks``
    and ``embedding`` name the block ModuleDict and the embedding module (the family's parallel plan)."""
    numels = {name: p.numel() for name, p in model.named_parameters()}
    total = sum(numels.values())
    routed = sum(n for name, n in numels.items() if facts is not None and facts.is_routed_expert(name, blocks))
    idle = routed * (facts.num_experts - facts.top_k) // facts.num_experts if facts is not None else 0
    weight = model.get_submodule(embedding).get_parameter("weight")
    # A tied matrix is listed twice when duplicates are kept: once as the embedding, once as the output.
    uses = sum(p is weight for _, p in model.named_parameters(remove_duplicate=False))
    return ParamCounts(total=total, active=total - idle, routed_experts=routed,
                       embedding_lookup=weight.numel() if uses == 1 else 0)


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """The attention's part of ``training_flops_per_token``: scores and their weighted sum over all ``seq_len``
    keys of the window (what a document mask scales down, components/metrics.py)."""
    return 6 * shape.n_layers * shape.n_heads * (shape.head_dim + shape.v_head_dim) * seq_len


def training_flops_per_token(counts: ParamCounts, shape: ModelShape, seq_len: int) -> int:
    """Forward + backward FLOPs per token at ``seq_len`` (see the module docstring): what MFU and the dry run
    count, for every family."""
    return 6 * counts.active_matmul + attention_flops_per_token(shape, seq_len)


def expert_layout_text(facts: MoEFacts, *, n_layers: int, ep: int, dp_shard: int, fsdp: bool, tp: int = 1,
                       cp: int = 1) -> str:
    """One line: the routed experts and how the ranks hold them (under TP each rank holds hidden / tp of each;
    context-parallel ranks hold the same weights, so FSDP shards them over cp as well, and EP takes its ranks from
    dp_shard x cp)."""
    text = (f"experts: {facts.num_experts} routed (top-{facts.top_k}, hidden {facts.expert_hidden_dim}"
            + (f", shared hidden {facts.shared_hidden_dim}" if facts.shared_hidden_dim else "")
            + f") in {len(facts.layers)} of {n_layers} blocks; ")
    split = f", each expert's hidden dim split over TP {tp}" if tp > 1 else ""
    if ep == 1:
        return text + ("no EP: every rank routes to all experts, " +
                       (f"their weights sharded by FSDP {dp_shard * cp} with the rest" if fsdp and dp_shard * cp > 1
                        else "their weights whole on each rank" if tp == 1 else "their weights not FSDP-sharded")
                       + split)
    # Under CP expert parallelism borrows its ranks from dp_shard x cp (mesh/parallel_dims.py).
    expert_fsdp = dp_shard * cp // ep
    ranks = f"dp_shard {dp_shard} x cp {cp}" if cp > 1 else f"dp_shard {dp_shard}"
    held = (f"their weights sharded by FSDP {expert_fsdp} ({ranks} / ep {ep})" if fsdp and expert_fsdp > 1
            else f"their weights {'whole on each rank' if tp == 1 else 'not FSDP-sharded'} ({ranks} / ep {ep} = 1)")
    return text + (f"EP {ep}: {facts.num_experts // ep} experts per rank, {held}{split}; tokens travel by all-to-all "
                   f"within each group of {ep} EP ranks" + (" of one TP coordinate" if tp > 1 else ""))
