"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus) sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens; None keeps all. top_k=1 is greedy."""
    top_p: float | None = None
    """Sample only among the most likely tokens whose probabilities sum to at least p; None keeps all."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or None to keep every token")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1], or None to keep every token")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [batch] chosen from the last-position ``logits`` [batch, vocab]."""
    if config.greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / config.temperature
    if config.top_k is not None and config.top_k < scores.shape[-1]:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the more likely ones already reach p; the most likely token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
