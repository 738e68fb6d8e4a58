"""The per-token widths of a family's attention that context parallelism moves and attention keeps, as data.

Under context parallelism (parallelism.cp) every rank attends with its own chunk of queries over the keys and
values of the whole sequence, all-gathered from its CP group. What is gathered, and what attention then saves
for backward, depends on how a block makes K and V: grouped-query attention gathers K and V themselves (the
rank's key / value heads, before any repeat), latent attention gathers the small latent they are expanded from
(and expands it on every rank). The memory estimator reads only these widths, never the family's name; a
family whose K and V are not what is gathered says so with ``ModelSpec.attention_shape``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan_lite.protocols.model_shape import ModelShape


@dataclass(frozen=True)
class AttentionShape:
    kv_width: int
    """Channels of K and V together, per token over all heads, as attention reads them (before TP, which splits
    them by heads): kv_heads x (head_dim + v_head_dim)."""
    latent_width: int = 0
    """Channels per token that K and V are expanded from inside the block, the same on every TP rank (latent
    attention: the compressed latent and the rotary key every head shares); context parallelism gathers these
    instead of K and V. 0: K and V are gathered as they are."""

    def __post_init__(self) -> None:
        if self.kv_width < 1 or self.latent_width < 0:
            raise ValueError(f"attention shape: kv_width={self.kv_width} must be positive and latent_width="
                             f"{self.latent_width} not negative")


def grouped_query_shape(args: ModelShape) -> AttentionShape:
    """K and V of ``kv_heads`` heads, gathered as they are: what a family without its own rule has."""
    return AttentionShape(kv_width=args.kv_heads * (args.head_dim + args.v_head_dim))


def attention_shape(rule: Callable[[Any], AttentionShape] | None, args: ModelShape) -> AttentionShape:
    """The family's ``rule`` (``ModelSpec.attention_shape``) applied to ``args``, or the grouped-query shape."""
    return grouped_query_shape(args) if rule is None else rule(args)
