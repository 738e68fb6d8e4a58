"""What the core needs to know of a family's Mixture-of-Experts layers, stated by the family as data.

A family with routed experts registers ``ModelSpec.moe_facts`` (its args -> ``MoEFacts``); a dense family
leaves it None. The planning tools read only these facts, never the family's name: total and active
parameters and the training FLOPs per token (torchtitan_lite/protocols/model_size.py), expert bytes per rank under
expert parallelism and the routed activations (torchtitan_lite/memory/), and the EP rules at resolve time.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.protocols.module_names import unwrapped_name


@dataclass(frozen=True)
class MoEFacts:
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token is sent to."""
    expert_hidden_dim: int
    """SwiGLU width of one routed expert."""
    shared_hidden_dim: int
    """SwiGLU width of the dense shared experts every token passes through (0: none)."""
    layers: tuple[int, ...]
    """Indices of the blocks whose feed-forward is an MoE layer (a DeepSeek-V3 keeps its first blocks dense)."""
    experts: str
    """Module, relative to a block, holding the routed experts' weights stacked on dim 0 (one slice per
    expert), e.g. 'moe.experts': expert parallelism splits that dim."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe facts: top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    def is_routed_expert(self, fqn: str, blocks: str) -> bool:
        """``fqn`` (a parameter or module name) lies inside the routed experts of an MoE block. Wrapper
        modules that activation checkpointing and compile insert are looked through (``unwrapped_name``)."""
        parts = unwrapped_name(fqn).split(".")
        if len(parts) < 2 or parts[0] != blocks or not parts[1].isdigit() or int(parts[1]) not in self.layers:
            return False
        rest = ".".join(parts[2:])
        return rest == self.experts or rest.startswith(self.experts + ".")

    def check_ep(self, ep: int) -> None:
        """Expert parallelism gives every EP rank num_experts / ep whole experts."""
        if ep > 1 and self.num_experts % ep != 0:
            divisors = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(
                f"parallelism.ep={ep} must divide the model's num_experts={self.num_experts} (each EP rank holds "
                f"whole experts); use an ep among {', '.join(map(str, divisors))} that also divides dp_shard")
