"""Qwen3-MoE hyper-parameters: one dataclass that every flavor, the model and the HF adapter read."""
from __future__ import annotations

from dataclasses import dataclass, field

from models.common.arg_checks import check_head_groups, check_positive, check_positive_ints
from models.common.moe.layer import MoEArgs
from torchtitan_lite.protocols.moe_facts import MoEFacts


@dataclass
class Qwen3MoeModelArgs:
    dim: int = 2048
    """Width of the residual stream (HF hidden_size)."""
    n_layers: int = 48
    """Number of transformer blocks, every one with an MoE feed-forward."""
    n_heads: int = 32
    """Query heads."""
    n_kv_heads: int = 4
    """Key/value heads for grouped-query attention."""
    head_dim: int = 128
    """Channels per head; Qwen3 sets it explicitly, so n_heads * head_dim may differ from dim."""
    vocab_size: int = 151936
    """Rows of the embedding and of the output projection."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the q / k norms included)."""
    rope_theta: float = 1000000.0
    """Base of the rotary frequencies."""
    max_seq_len: int = 40960
    """Length of the precomputed rotary table: the longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """Share one matrix between tok_embeddings and output."""
    depth_init: bool = True
    """Scale the init std of each block's output projections by its depth (as Llama 3's args)."""
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=128, top_k=8, hidden_dim=768))
    """The MoE feed-forward of every block (Qwen3-MoE: softmax router, normalised top-k, no shared experts)."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len"))
        check_head_groups(self.n_heads, self.n_kv_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(f"model args: head_dim={self.head_dim} must be even, since rotary embeddings rotate "
                             "pairs of channels")
        check_positive(self, ("norm_eps", "rope_theta"))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def v_head_dim(self) -> int:
        """Each head's value is as wide as its query and key."""
        return self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """No dense feed-forward: every block is an MoE layer (its widths are in moe_facts)."""
        return 0

    def moe_facts(self) -> MoEFacts:
        """Every block's feed-forward is an MoE layer (``layers.<i>.moe``)."""
        return self.moe.facts(layers=tuple(range(self.n_layers)))
