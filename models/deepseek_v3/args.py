"""DeepSeek-V3 hyper-parameters: one dataclass that every flavor, the model and the HF adapter read."""
from __future__ import annotations

from dataclasses import dataclass, field

from models.common.arg_checks import check_positive, check_positive_ints
from models.common.attention.yarn import YarnScaling
from models.common.moe.layer import MoEArgs
from torchtitan_lite.protocols.moe_facts import MoEFacts


@dataclass
class DeepSeekV3ModelArgs:
    dim: int = 7168
    """Width of the residual stream (HF hidden_size)."""
    n_layers: int = 61
    """Transformer blocks: the first n_dense_layers with a dense SwiGLU, the rest with the MoE."""
    n_heads: int = 128
    """Attention heads (each with its own key and value: MLA has no grouped-query sharing)."""
    vocab_size: int = 129280
    """Rows of the embedding and of the output projection."""
    q_lora_rank: int = 1536
    """Rank of the low-rank query (wq_a -> RMSNorm -> wq_b); 0: one full-rank wq (DeepSeek-V2-Lite, Moonlight)."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (the KV cache of inference)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without position, expanded from the latent."""
    qk_rope_head_dim: int = 64
    """Per-head query channels with the rotary embedding; the key's rope part is one vector shared by all heads."""
    v_head_dim: int = 128
    """Per-head value channels."""
    n_dense_layers: int = 3
    """The first blocks with a dense SwiGLU instead of the MoE (HF first_k_dense_replace)."""
    dense_hidden_dim: int = 18432
    """SwiGLU width of the dense blocks (HF intermediate_size)."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (HF rms_norm_eps); the latent norms use 1e-6 always, as HF's."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    """YaRN context extension of the rotary table and the softmax scale; None: plain RoPE."""
    max_seq_len: int = 163840
    """Length of the precomputed rotary table: the longest sequence the model accepts."""
    tie_word_embeddings: bool = False
    """Share one matrix between tok_embeddings and output."""
    depth_init: bool = True
    """Scale the init std of each block's output projections by its depth (as Llama 3's args)."""
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(
        num_experts=256, top_k=8, hidden_dim=2048, score_func="sigmoid", norm_topk_prob=True, route_scale=2.5,
        num_groups=8, topk_groups=4, num_shared_experts=1, bias_update_rate=1e-3, aux_loss_coeff=1e-4))
    """The MoE feed-forward of the blocks after the dense ones (DeepSeekMoE)."""

    def __post_init__(self) -> None:
        check_positive_ints(self, ("dim", "n_layers", "n_heads", "vocab_size", "kv_lora_rank", "qk_nope_head_dim",
                                   "qk_rope_head_dim", "v_head_dim", "dense_hidden_dim", "max_seq_len"))
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ValueError(f"model args: q_lora_rank={self.q_lora_rank!r} must be a non-negative integer "
                             "(0: a full-rank query projection)")
        if not isinstance(self.n_dense_layers, int) or not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"model args: n_dense_layers={self.n_dense_layers!r} must be between 0 and "
                             f"n_layers={self.n_layers}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model args: qk_rope_head_dim={self.qk_rope_head_dim} must be even, since rotary "
                             "embeddings rotate pairs of channels")
        check_positive(self, ("norm_eps", "rope_theta"))

    @property
    def kv_heads(self) -> int:
        """Key/value heads: as many as query heads (MLA expands each head's key and value from the latent)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """Channels of each head's query and key (nope + rope part), the width the attention scores are taken over."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """head_dim ** -0.5, times YaRN's mscale squared when the rotary table is scaled."""
        scale = self.head_dim ** -0.5
        return scale * self.rope_scaling.softmax_scale_factor if self.rope_scaling is not None else scale

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def moe_facts(self) -> MoEFacts:
        """The blocks after the first n_dense_layers carry the MoE layer (``layers.<i>.moe``)."""
        return self.moe.facts(layers=tuple(range(self.n_dense_layers, self.n_layers)))

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU width of the dense blocks (the MoE blocks' widths are in moe_facts)."""
        return self.dense_hidden_dim
