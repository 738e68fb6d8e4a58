"""Load balancing of routed experts, both ways users ask for.

* Auxiliary-loss-free (DeepSeek-V3): a per-expert bias added to the scores when experts are *selected*
  (never to the combine weights), nudged after every applied optimizer step by ``rate * sign(mean load -
  load)``: an overloaded expert becomes less attractive, an idle one more.
* Sequence-level auxiliary loss (DeepSeek-V3 eq. 17-20): ``sum_i f_i * P_i`` per sequence, averaged over
  the batch, where f_i = E / (k * S) * (tokens of the sequence routed to i) and P_i = mean over the
  sequence of the token's normalised score for i. It is 1 for a perfectly balanced router and grows
  to E / k when every token picks the same k experts with all their score.
"""
from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from torchtitan_lite.mesh.sequence_collectives import sum_over_sequence


def expert_bias_delta(tokens_per_expert: torch.Tensor, rate: float) -> torch.Tensor:
    """The change of the expert bias for the loads ``tokens_per_expert`` [E] of one step.

    Centred to mean zero: a common shift of every bias changes no top-k choice, and centring keeps the
    bias from drifting as a whole over a long run.
    """
    loads = tokens_per_expert.float()
    delta = rate * torch.sign(loads.mean() - loads)
    return delta - delta.mean()


def sequence_aux_loss(scores: torch.Tensor, experts: torch.Tensor, num_experts: int,
                      cp_group: ProcessGroup | None = None) -> torch.Tensor:
    """Sequence-level balance loss (without its coefficient) of scores [B, S, E] and chosen experts [B, S, k].

    Under context parallelism (``cp_group``) a rank holds only its chunks of each sequence: the per-sequence
    counts and score sums are summed over the CP ranks, so that every rank computes the whole sequence's loss,
    and each rank's backward reaches its own tokens' scores (``sum_over_sequence``)."""
    batch, seq_len, top_k = experts.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)  # softmax scores already sum to 1; sigmoid ones do not
    counts = torch.zeros(batch, num_experts, device=scores.device, dtype=scores.dtype)
    counts.scatter_add_(1, experts.reshape(batch, -1), torch.ones_like(experts.reshape(batch, -1), dtype=scores.dtype))
    if cp_group is None:
        p = probs.mean(dim=1)  # [B, E]
    else:
        seq_len *= cp_group.size()
        p = sum_over_sequence(probs.sum(dim=1), cp_group) / seq_len
        counts = sum_over_sequence(counts, cp_group)
    f = counts * (num_experts / (top_k * seq_len))
    return (f * p).sum(dim=-1).mean()
