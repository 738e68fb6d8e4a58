"""The decoder-only skeleton every family shares: token embedding -> blocks -> final RMSNorm -> output.

A family supplies its args and its block; the skeleton owns the module names (tok_embeddings, rope, layers,
norm, output) that the parallelisms, the checkpoint and the HF adapters read, the optional tying of the
embedding and output matrices, the initialisation of the parts outside the blocks, and the forward.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, cast

import torch
from torch import nn

from models.common.attention.mask import Mask, build_mask
from models.common.attention.rope import RotaryEmbedding, RotaryScaling, rope_at
from models.common.decoder_args import DecoderArgs
from models.common.decoder_names import BLOCKS, EMBEDDING
from models.common.init import trunc_normal_
from models.common.rms_norm import RMSNorm
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.model_size import ParamCounts, param_counts, training_flops_per_token
from torchtitan_lite.protocols.moe_facts import MoEFacts


class DecoderBlock(Protocol):
    """One block: initialises itself, maps the residual stream [batch, seq, dim] given the rotary table (whole, or
    one row per token) and the attention mask (None: causal)."""

    def init_weights(self) -> None: ...
    def __call__(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Mask | None = None) -> torch.Tensor: ...


ArgsT = TypeVar("ArgsT", bound=DecoderArgs)


class Decoder(BaseModel, Generic[ArgsT]):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. Build on meta, then `to_empty` + `init_weights`.

    A pipeline stage (``torchtitan_lite.distributed.pipeline.stage_model``) sets tok_embeddings to None unless
    it is the first stage, norm and output unless it is the last; every method here allows for that."""

    def __init__(self, args: ArgsT, make_block: Callable[[int], nn.Module],
                 rope_scaling: RotaryScaling | None = None, rope_dim: int | None = None) -> None:
        """``rope_dim``: channels per head the rotary table rotates; default args.head_dim (all of them)."""
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(args.head_dim if rope_dim is None else rope_dim, args.max_seq_len,
                                    args.rope_theta, rope_scaling)
        self.layers = nn.ModuleDict({str(i): make_block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.init_weights()

    def tie_embeddings(self) -> None:
        """Make output share tok_embeddings.weight when the args tie them (no-op otherwise or when already shared).

        Call again after anything that replaces parameters, e.g. tensor parallelism distributing each
        module separately, and before fully_shard so that FSDP sees one parameter."""
        if self.tok_embeddings is None or self.output is None:
            return  # a pipeline stage (pipelines refuse tied embeddings)
        if self.args.tie_word_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Decoder[ArgsT]:
        # Moving off the meta device gives each module its own new Parameter, which would silently
        # untie a shared embedding; restore the sharing after every conversion.
        super()._apply(fn, recurse)
        self.tie_embeddings()
        return self

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Initialise every parameter in place and recompute the rotary table on `buffer_device`.

        Untied embeddings get normal(0, 1) (torchtitan's choice): every block reads the residual stream
        through an RMSNorm, so the scale costs nothing there, and a unit-scale stream keeps the first updates
        of the small-init projections gentle relative to it. A tied matrix is also the output projection,
        so it gets the output's std dim**-0.5 instead, which starts the logits near unit scale.
        """
        self.rope.reset_cache(buffer_device)
        out_std = self.args.dim ** -0.5
        if self.args.tie_word_embeddings:
            assert self.tok_embeddings is not None
            trunc_normal_(self.tok_embeddings.weight, std=out_std)
        else:
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
            if self.output is not None:
                trunc_normal_(self.output.weight, std=out_std)
        for layer in self.layers.values():
            cast(DecoderBlock, layer).init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                q_index: torch.Tensor | None = None, kv_index: torch.Tensor | None = None,
                q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits; a pipeline stage without the embedding takes the previous stage's
        hidden states [batch, seq, dim] instead, and one without the head returns its hidden states.

        The keyword tensors describe the sequence's layout (torchtitan_lite/components/data/sequence_layout.py):
        ``positions`` the rotary position of each token (default 0..seq-1); ``q_index`` / ``kv_index`` and
        ``q_doc`` / ``kv_doc`` the window index and document of each query and key, from which the attention
        mask is built once for every block. Without them attention is causal over the window."""
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len={self.args.max_seq_len}; "
                "shorten training.seq_len or use a flavor with a longer max_seq_len"
            )
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        rope = rope_at(self.rope.cache, positions)
        if q_index is None or kv_index is None:
            for layer in self.layers.values():
                h = layer(h, rope)
        else:
            mask = build_mask(q_index, kv_index, q_doc, kv_doc)
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once); global sizes for DTensor-sharded models."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total

    def moe_facts(self) -> MoEFacts | None:
        """The family's MoE layers as data (the same function its ModelSpec.moe_facts registers); None: dense."""
        return None

    def param_counts(self) -> ParamCounts:
        """Total and active (per token) parameters: a token skips the routed experts it is not sent to."""
        return param_counts(self, self.moe_facts(), blocks=BLOCKS, embedding=EMBEDDING)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token, the PaLM / torchtitan estimate on the active
        parameters (torchtitan_lite/protocols/model_size.py):

            6 * N_active + 6 * n_layers * n_heads * (head_dim + v_head_dim) * seq_len

        N_active counts the parameters used in matmuls for each token: all but the embedding lookup (a tied
        matrix counts as the output projection) and the routed experts a token is not sent to.
        """
        return training_flops_per_token(self.param_counts(), self.args, seq_len)
