"""The pre-norm residual block every family shares: h = x + attention(norm(x)); out = h + ffn(norm(h))."""
from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from models.common.attention.mask import Mask
from models.common.decoder_args import DecoderArgs
from models.common.rms_norm import RMSNorm


class BlockPart(Protocol):
    """An attention or feed-forward part: initialises itself given the std of its output projection."""

    def init_weights(self, out_proj_std: float) -> None: ...


class PreNormBlock(nn.Module):
    """Attention and a feed-forward part, each behind an RMSNorm on a residual branch.

    The feed-forward part is registered under the family's name for it (`feed_forward`, `moe`), between the
    two norms, so that each family keeps its state-dict keys and parameter order."""

    def __init__(self, layer_id: int, args: DecoderArgs, attention: nn.Module, ffn_name: str, ffn: nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.add_module(ffn_name, ffn)
        self.ffn_name = ffn_name
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Smaller init for the projections that write into the residual stream keeps its variance from
        # growing with depth (GPT-2 / torchtitan scheme).
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_proj_std = 0.02 / (2 * depth) ** 0.5

    def ffn(self) -> nn.Module:
        """The feed-forward part, whatever the family calls it."""
        return cast(nn.Module, getattr(self, self.ffn_name))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        for part in (self.attention, self.ffn()):
            cast(BlockPart, part).init_weights(self.out_proj_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        # The mask goes by keyword: TP prepares the attention's positional inputs (x, the rotary table) only.
        h = x + self.attention(self.attention_norm(x), rope_cache, mask=mask)
        return h + self.ffn()(self.ffn_norm(h))
