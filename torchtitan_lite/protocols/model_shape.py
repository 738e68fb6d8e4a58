"""What the core needs to know of a family's transformer shape, read off its args.

Every family's args (models/common/decoder_args.py's ``DecoderArgs`` extends this) provide these as fields or
properties, so the core reads one name per fact: the TP split checks (``resolve_run``), the training FLOPs
per token (model_size.py), the memory estimate's activations and the pipeline's tied-embedding rule. The
widths per block kind are data as well: the dense feed-forward's here, the routed experts' in ``MoEFacts``
(protocols/moe_facts.py).
"""
from __future__ import annotations

from typing import Protocol


class ModelShape(Protocol):
    """Read-only view of a family's model args (fields or properties)."""

    @property
    def dim(self) -> int:
        """Width of the residual stream."""
        ...

    @property
    def n_layers(self) -> int:
        """Transformer blocks."""
        ...

    @property
    def n_heads(self) -> int:
        """Query heads."""
        ...

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_heads without grouped-query sharing)."""
        ...

    @property
    def head_dim(self) -> int:
        """Channels of each head's query and key: the width the attention scores are taken over."""
        ...

    @property
    def v_head_dim(self) -> int:
        """Channels of each head's value: the width of the scores' weighted sum (head_dim but in latent
        attention)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and of the output projection."""
        ...

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model accepts."""
        ...

    @property
    def tie_word_embeddings(self) -> bool:
        """One matrix is both the embedding and the output projection."""
        ...

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width of the dense feed-forward blocks; 0 when every block is an MoE layer (whose widths are
        in the family's MoEFacts)."""
        ...
