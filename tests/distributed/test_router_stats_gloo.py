"""The router metrics are counted per rank and summed over the data-parallel ranks: every rank reads the
balance of the global batch, not of its own share."""
from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_ranks
from torch import nn

from models.common.moe.layer import MoE, MoEArgs
from models.common.moe.router_stats import router_stats


def _stats_of_planted_counts(rank: int, world_size: int) -> dict[str, float]:
    moe = MoE(8, MoEArgs(num_experts=4, top_k=1, hidden_dim=8, aux_loss_coeff=0.1))
    moe.init_weights(out_proj_std=0.02)
    # Rank 0 routed everything to expert 0, rank 1 to expert 1: each alone is collapsed (imbalance 4, 3 of 4
    # experts dead), together they fill two experts (imbalance 2, half dead).
    moe.routed_tokens.copy_(torch.tensor([6, 0, 0, 0]) if rank == 0 else torch.tensor([0, 6, 0, 0]))
    # Balance loss summed over 1 forward on rank 0 (0.5) and 3 on rank 1 (0.25 each): 1.25 over 4 forwards.
    moe.aux_loss_window.copy_(torch.tensor([0.5, 1.0]) if rank == 0 else torch.tensor([0.75, 3.0]))
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module()})
    model.layers["0"].moe = moe
    return {tag: float(value) for tag, value in router_stats(model, dist.group.WORLD).items()}


def test_router_stats_sum_the_counts_over_data_parallel_ranks():
    expected = {"moe/layers.0/imbalance": 2.0, "moe/layers.0/dead_share": 0.5, "moe/imbalance_max": 2.0,
                "moe/dead_share": 0.5, "moe/aux_loss": 1.25 / 4}
    # Exact: small integers and binary fractions (0.3125) in float32.
    assert run_ranks(_stats_of_planted_counts, 2, timeout_s=120) == [expected, expected]
