"""The decoder skeleton of a family with MoE layers: the trainer-facing MoE hooks every such family shares.

The MoE layers (models/common/moe/layer.py) hold their own balancing state; this base turns the model-wide calls
the trainer makes (torchtitan_lite/protocols/model.py ``BaseModel``) into calls on every MoE layer of the model
(models/common/moe/hooks.py, models/common/moe/router_stats.py), and reports the family's MoE layers as data
(``moe_facts``, from its args). A family adds only what differs: its blocks, its rotary table, FLOPs, ...
"""
from __future__ import annotations

from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from models.common.decoder import Decoder
from models.common.decoder_args import DecoderArgs
from models.common.moe.hooks import set_aux_loss_scale, update_expert_biases
from models.common.moe.router_stats import merge_router_stats, router_stats, router_summary
from torchtitan_lite.protocols.moe_facts import MoEFacts


class MoEDecoderArgs(DecoderArgs, Protocol):
    """Model args of a family with MoE layers: the decoder's, and where its MoE layers are."""

    def moe_facts(self) -> MoEFacts: ...


MoEArgsT = TypeVar("MoEArgsT", bound=MoEDecoderArgs)


class MoEDecoder(Decoder[MoEArgsT]):
    """A Decoder whose blocks hold MoE layers (``layers.<i>.moe``) in some or all of them."""

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of the MoE layers' balance loss in the coming backward passes."""
        set_aux_loss_scale(self, scale)

    def post_optimizer_step(self, dp_group: dist.ProcessGroup | None) -> None:
        """Move every MoE layer's expert bias toward balance from the loads of the step (when the bias is on)."""
        update_expert_biases(self, dp_group)

    def training_stats(self, dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
        """The routers' load balance since the previous call (models/common/moe/router_stats.py)."""
        return router_stats(self, dp_group)

    def merge_training_stats(self, parts: list[dict[str, float]]) -> dict[str, float]:
        return merge_router_stats(parts)

    def training_stats_summary(self, values: dict[str, float]) -> str | None:
        return router_summary(values)

    def moe_facts(self) -> MoEFacts:
        """The family's MoE layers as data: its args' ``moe_facts`` (the one its ModelSpec registers)."""
        return self.args.moe_facts()
