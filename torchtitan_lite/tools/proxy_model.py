"""A cut-down model that still represents the full one's FLOP split: enough blocks that the output head
(which FP8 recipes leave in BF16) is at most a given share of the training FLOPs.

A published size cut to a few blocks is mostly head: at the 8B width with 4 blocks and 8192 tokens the head
is ~30% of the FLOPs, so no FP8 recipe can pass ~1.2x there, whatever its GEMMs gain. At 32 blocks the head
is ~5%. ``layers_for_head_share`` picks the fewest blocks that bring the head under the share asked for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ProxyShape:
    n_layers: int
    head_share: float
    """The output projection's share of the training FLOPs per token at this depth."""
    block_flops: int
    """Training FLOPs per token of one block (its matmuls, 6 x parameters, and causal attention)."""
    head_flops: int


def flops_split(family: str, flavor: str, *, seq_len: int) -> tuple[int, int]:
    """(training FLOPs per token of one block, of the output projection) of ``family``'s ``flavor``, counted as
    the trainer counts them (6 x matmul parameters + 12 x heads x head_dim x seq_len per block)."""
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    spec = get_model_spec(family)
    args = build_model_args(spec, flavor, n_layers=1)
    with torch.device("meta"):
        model = spec.model_cls(args)
    plan = spec.parallel_plan
    block = sum(p.numel() for name, p in model.named_parameters() if name.startswith(f"{plan.blocks}.0.")
                and not name.endswith("norm.weight"))
    head = next(m for name, m in model.named_modules() if name == plan.output)
    assert isinstance(head, nn.Linear)
    attention = 12 * args.n_heads * (args.dim // args.n_heads) * seq_len
    return 6 * block + attention, 6 * head.in_features * head.out_features


def layers_for_head_share(family: str, flavor: str, *, seq_len: int, max_share: float) -> ProxyShape:
    """The fewest blocks for which the head is at most ``max_share`` of the training FLOPs per token."""
    if not 0 < max_share < 1:
        raise ValueError(f"max_share must be in (0, 1), got {max_share}")
    block, head = flops_split(family, flavor, seq_len=seq_len)
    n = 1
    while head / (head + n * block) > max_share:
        n += 1
    return ProxyShape(n, head / (head + n * block), block, head)


def fitting_ac_mode(configs: list[str], overrides: list[str], *, device_bytes: int, registry: object,
                    margin: float = 0.9) -> tuple[str | None, float]:
    """The lightest activation checkpointing (selective op, then full) under which every config's estimated
    peak (``--estimate-memory``'s, CUDA) stays under ``margin`` x ``device_bytes``; with the largest peak in
    GiB. None when even full checkpointing does not fit."""
    from torchtitan_lite.config import parse_cli
    from torchtitan_lite.memory.estimate import estimate_memory

    peak = 0.0
    for mode in ("selective", "full"):
        peak = 0.0
        for name in configs:
            cli = parse_cli(["--config", name, *overrides, "--activation_checkpoint.mode", mode],
                            registry=registry)  # type: ignore[arg-type]
            peak = max(peak, estimate_memory(cli.config, world_size=1, device_type="cuda").total / 1024**3)
        if peak * 1024**3 <= margin * device_bytes:
            return mode, peak
    return None, peak
