"""Llama 3 hyper-parameters: one dataclass that every flavor, the model and the HF adapter read."""
from __future__ import annotations

from dataclasses import dataclass

from models.common.arg_checks import check_head_groups, check_positive, check_positive_ints
from models.common.attention.rope_scaling import RopeScaling

__all__ = ["Llama3ModelArgs", "RopeScaling"]


@dataclass
class Llama3ModelArgs:
    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head attention)."""
    vocab_size: int = 128256
    """Rows of the embedding and of the output projection."""
    multiple_of: int = 256
    """The feed-forward width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the default 2/3 * 4 * dim feed-forward width before rounding; None means 1."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 long-context frequency scaling; None leaves the frequencies unscaled."""
    max_seq_len: int = 8192
    """Length of the precomputed rotary table: the longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """Share one matrix between tok_embeddings and output (Llama 3.2 1B / 3B)."""
    depth_init: bool = True
    """Scale the init std of each block's output projections by its depth (0.02 / sqrt(2 * (layer_id + 1)));
    False scales all blocks by the total depth (0.02 / sqrt(2 * n_layers))."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_positive_ints(self, ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"))
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model args: dim={self.dim} must be divisible by n_heads={self.n_heads}; "
                f"choose n_heads among the divisors of {self.dim}"
            )
        check_head_groups(self.n_heads, self.n_kv_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"model args: head_dim = dim / n_heads = {self.head_dim} must be even, since rotary embeddings "
                "rotate pairs of channels; change dim or n_heads"
            )
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(f"model args: ffn_dim_multiplier={self.ffn_dim_multiplier} must be positive or None")
        check_positive(self, ("norm_eps", "rope_theta"))

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, which defaults to n_heads)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def v_head_dim(self) -> int:
        """Each head's value is as wide as its query and key."""
        return self.head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width exactly as Meta's Llama 3 code: 2/3 of 4*dim, times the multiplier, rounded up."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
