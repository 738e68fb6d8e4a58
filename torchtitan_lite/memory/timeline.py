"""Device memory at the moments of a training step where the peak can occur.

Within one step, memory only grows through forward (activations are saved), so the candidates are the
moments of backward and the optimizer step:

- loss: the cross-entropy forward/backward on top of every saved activation;
- output backward: the logits' gradient and the head's gradient buffers;
- block i backward, from the last block down to the first: blocks 0..i still hold their activations,
  block i's recomputation (AC), activation gradients and gradient
  buffers are live, and the gradients of the head and of blocks i+1..L-1 exist (block i's own weight
  gradients appear while its saved activations and activation gradients are being freed, so they are
  not added at the moment its working set peaks);
- embedding backward: every gradient plus the embedding's gradient buffers;
- optimizer step: every gradient plus the optimizer's scratch.

With gradient accumulation all gradients exist from the second micro-batch on, so every moment holds
them. FSDP units that are gathered at each moment follow fsdp_reshard_after_forward (distributed/fsdp.py):
'default' keeps the head (and a tied root) and the last block gathered after forward and prefetches one
unit ahead in backward; 'always' reshards everything after forward; 'never' keeps every unit gathered.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSizes:
    """Byte counts the timeline combines; per-unit dicts are keyed by FSDP unit name."""

    persistent: int
    """Parameters, optimizer states and buffers resident on the device."""
    grads: dict[str, int]
    """Gradients per unit (0 on the device with CPU offload)."""
    grad_buffers: dict[str, int]
    """Transient buffers while a unit's gradients are produced / reduced."""
    gathered: dict[str, int]
    """All-gathered parameter bytes per unit (empty without FSDP)."""
    block_plan: list[tuple[int, int]]
    """Per block: (activation bytes kept for backward, bytes recomputed in its backward)."""
    head_saved: int
    autocast_copies: int
    """Autocast's cached low-precision weight copies (0 without autocast)."""
    loss_transient: int
    logits_grad: int
    block_working: int
    """Activation gradients and float8 casts inside one block's backward."""
    optimizer_scratch: int
    accumulating: bool
    reshard_after_forward: str
    head_units: tuple[str, ...]
    """'head' (norm + output) and/or 'root' (a tied embedding lives there)."""


def step_moments(z: StepSizes) -> list[tuple[str, int]]:
    n = len(z.block_plan)
    blocks = [f"layers.{i}" for i in range(n)]
    all_grads = sum(z.grads.values())

    def grads_done(units: list[str]) -> int:
        return all_grads if z.accumulating else sum(z.grads.get(u, 0) for u in units)

    def gathered(units: list[str]) -> int:
        if z.reshard_after_forward == "never":
            return sum(z.gathered.values())
        return sum(z.gathered.get(u, 0) for u in set(units))

    # Units gathered when forward has just finished (still gathered when backward starts).
    kept_after_forward = [] if z.reshard_after_forward == "always" else list(z.head_units) + blocks[-1:]
    saved = [kept for kept, _ in z.block_plan]
    # Autocast keeps its weight casts cached until the autocast region exits, and the training step runs
    # backward inside that region: they live until the optimizer step.
    copies = z.autocast_copies
    moments = [
        ("loss", z.persistent + sum(saved) + z.head_saved + copies
         + gathered(kept_after_forward) + z.loss_transient + grads_done([])),
        ("output backward", z.persistent + sum(saved) + copies
         + gathered(list(z.head_units) + blocks[-1:]) + z.logits_grad
         + sum(z.grad_buffers.get(u, 0) for u in z.head_units) + grads_done(list(z.head_units))),
    ]
    for i in reversed(range(n)):
        # Block i computes while the next unit to run backward (block i-1, or the embedding) is prefetched;
        # a tied root stays gathered until its own post-backward at the very end.
        prefetched = blocks[i - 1] if i > 0 else "tok_embeddings"
        units = [blocks[i], prefetched] + [u for u in z.head_units if u == "root"]
        moments.append((f"block {i} backward", z.persistent + sum(saved[: i + 1]) + copies
                        + z.block_plan[i][1] + z.block_working + z.grad_buffers.get(blocks[i], 0)
                        + gathered(units) + grads_done(list(z.head_units) + blocks[i + 1:])))
    moments.append(("embedding backward", z.persistent + all_grads + copies + z.grad_buffers.get("tok_embeddings", 0)
                    + gathered(["tok_embeddings"] + [u for u in z.head_units if u == "root"])))
    moments.append(("optimizer step", z.persistent + all_grads + z.optimizer_scratch))
    return moments
