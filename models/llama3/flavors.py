"""Llama 3 size presets: a debug model for CPUs and the published Llama 3.1 / 3.2 shapes."""
from __future__ import annotations

from typing import Any

from models.llama3.args import Llama3ModelArgs, RopeScaling

# Llama 3.1 stretches an 8k-trained rotary spectrum to 128k; Llama 3.2 1B/3B use a factor of 32.
_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _published(**shape: Any) -> Llama3ModelArgs:
    """A published Llama 3 shape: 128k vocabulary, rope theta 5e5, 128k context."""
    return Llama3ModelArgs(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072, **shape)


LLAMA3_FLAVORS: dict[str, Llama3ModelArgs] = {
    # ~5.8M parameters: trains in a couple of minutes on two CPU cores.
    "debug": Llama3ModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=256,
        rope_theta=500000.0, max_seq_len=2048, norm_eps=1e-5,
    ),
    "1B": _published(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    "3B": _published(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True,
    ),
    "8B": _published(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "70B": _published(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_scaling=_LLAMA31_ROPE,
    ),
    "405B": _published(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
        rope_scaling=_LLAMA31_ROPE,
    ),
}
