"""The router's health as a run reports it: how evenly the tokens spread over the experts of each MoE layer.

Read at log steps only, over every training forward since the previous read (the log interval), from counts
the MoE layers keep on the device (``routed_tokens``, ``aux_loss_window``), summed over the data-parallel
ranks. Reading resets them; the counts the expert-bias update consumes are separate and stay untouched.

TensorBoard tags (values are device scalars until the trainer reads them, all at once):
  * ``moe/<layer>/imbalance``: max / mean tokens per expert (1 = balanced, num_experts = every token to one
    expert); ``moe/imbalance_max`` the worst layer's;
  * ``moe/<layer>/dead_share``: share of the layer's experts that received no token; ``moe/dead_share`` the
    share over all layers;
  * ``moe/<layer>/bias_min`` / ``bias_max``: the expert-bias range (layers with the bias on);
  * ``moe/aux_loss``: the coefficient-weighted balance loss added to the training loss, summed over layers and
    averaged over the micro-batches of the interval (when the loss is on).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.common.moe.layer import MoE
from torchtitan_lite.protocols.module_names import unwrapped_name


def named_moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer; the name is the block holding it (``layers.3``), wrapper modules
    (activation checkpointing, torch.compile) left out."""
    named = []
    for fqn, module in model.named_modules():
        if isinstance(module, MoE):
            named.append((unwrapped_name(fqn).removesuffix(".moe"), module))
    return named


def load_imbalance(loads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max / mean, share of zeros) of the tokens per expert ``loads`` [E]; (0, 1) when no token was routed."""
    loads = loads.float()
    imbalance = loads.max() / loads.mean().clamp_min(torch.finfo(torch.float32).tiny)
    dead_share = (loads == 0).float().mean()
    return imbalance, dead_share


@torch.no_grad()
def router_stats(model: nn.Module, dp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The tags above -> device scalars, over the forwards since the previous call, which this call starts
    anew. Collective over ``dp_group`` (one all-reduce): every rank calls it on the same steps. Reads
    nothing to the host. Empty for a model without MoE layers."""
    layers = named_moe_layers(model)
    if not layers:
        return {}
    # One flat vector for one all-reduce: every layer's loads, then every layer's [aux loss sum, forwards].
    # float64 holds token counts exactly.
    window = torch.cat([layer.routed_tokens.double() for _, layer in layers]
                       + [layer.aux_loss_window.double() for _, layer in layers])
    for _, layer in layers:
        layer.routed_tokens.zero_()
        layer.aux_loss_window.zero_()
    if dp_group is not None:
        dist.all_reduce(window, group=dp_group)
    loads = window[:-2 * len(layers)].split([layer.args.num_experts for _, layer in layers])
    aux = window[-2 * len(layers):].view(len(layers), 2)

    stats: dict[str, torch.Tensor] = {}
    imbalances, dead = [], []
    for (name, layer), layer_loads in zip(layers, loads, strict=True):
        imbalance, dead_share = load_imbalance(layer_loads)
        stats[f"moe/{name}/imbalance"] = imbalance
        stats[f"moe/{name}/dead_share"] = dead_share
        if layer.uses_expert_bias:
            stats[f"moe/{name}/bias_min"] = layer.expert_bias.min()
            stats[f"moe/{name}/bias_max"] = layer.expert_bias.max()
        imbalances.append(imbalance)
        dead.append(dead_share * layer.args.num_experts)
    stats["moe/imbalance_max"] = torch.stack(imbalances).max()
    stats["moe/dead_share"] = torch.stack(dead).sum() / sum(layer.args.num_experts for _, layer in layers)
    with_aux = [i for i, (_, layer) in enumerate(layers) if layer.args.aux_loss_coeff > 0]
    if with_aux:
        # Per layer the summed loss over its forwards (on all ranks) is the mean per micro-batch forward.
        sums, forwards = aux[with_aux, 0], aux[with_aux, 1]
        stats["moe/aux_loss"] = (sums / forwards.clamp_min(1)).sum().float()
    return stats


def merge_router_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Read ``router_stats`` values of several parts of one model (pipeline stages) as the whole model's: a layer
    lives on one stage, so the per-layer tags are disjoint; the worst imbalance is the parts' worst, the balance
    loss their sum, and the dead share their mean weighted by MoE layers (every MoE layer of a model has the
    same number of experts: one MoEArgs per model). A part without MoE layers has no values."""
    parts = [values for values in parts if "moe/imbalance_max" in values]
    merged: dict[str, float] = {}
    for values in parts:
        merged |= values
    if len(parts) > 1:
        layers = [sum(tag.endswith("/imbalance") for tag in values) for values in parts]
        merged["moe/imbalance_max"] = max(values["moe/imbalance_max"] for values in parts)
        merged["moe/dead_share"] = sum(v["moe/dead_share"] * n for v, n in zip(parts, layers, strict=True)) / sum(layers)
        aux = [values["moe/aux_loss"] for values in parts if "moe/aux_loss" in values]
        if aux:
            merged["moe/aux_loss"] = sum(aux)
    return merged


def router_summary(values: dict[str, float]) -> str | None:
    """The console's short form of read ``router_stats`` values: ``moe imb 1.80 (layers.3) dead 0.12 aux
    1.02e-03`` (the worst layer's imbalance, the share of experts without a token, the balance loss)."""
    if "moe/imbalance_max" not in values:
        return None
    per_layer = {tag[len("moe/"):-len("/imbalance")]: value for tag, value in values.items()
                 if tag.startswith("moe/") and tag.endswith("/imbalance")}
    worst = max(per_layer, key=per_layer.__getitem__)
    text = f"moe imb {values['moe/imbalance_max']:.2f} ({worst}) dead {values['moe/dead_share']:.2f}"
    if "moe/aux_loss" in values:
        text += f" aux {values['moe/aux_loss']:.3g}"
    return text
