"""Device memory at the moments of a training step where the peak can occur.

Within one step, memory only grows through forward (activations are saved), so the candidates are the
moments of backward and the optimizer step:

- loss: the cross-entropy forward/backward on top of every saved activation;
- output backward: the logits' gradient next to the head's unsharded weight gradients;
- head reduce-scatter: the head's unsharded gradients and their reduce_dtype copy;
- block i backward, from the last block down to the first: blocks 0..i still hold their activations,
  block i's recomputation (AC) and activation gradients are live, the gradients of the head and of
  blocks i+1..L-1 exist (block i's own weight gradients appear as its activations are freed);
- block i reduce-scatter: block i's activations are gone, its unsharded gradients and their
  reduce_dtype copy are live;
- embedding backward: every gradient plus the embedding's gradient buffers;
- optimizer step: every gradient plus the optimizer's scratch.

Without FSDP the "unsharded gradients" are autocast's low-precision weight gradients (cast into the
fp32 .grad right away) and there is nothing to reduce-scatter.

With gradient accumulation all gradients exist from the second micro-batch on, so every moment holds
them. FSDP units that are gathered at each moment follow fsdp_reshard_after_forward (distributed/fsdp.py):
'default' keeps the head (and a tied root) and the last block gathered after forward and prefetches one
unit ahead in backward; 'always' reshards everything after forward; 'never' keeps every unit gathered.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.protocols.model_spec import ROOT_UNIT


@dataclass(frozen=True)
class StepSizes:
    """Byte counts the timeline combines; per-unit dicts are keyed by FSDP unit name."""

    persistent: int
    """Parameters, optimizer states and buffers resident on the device."""
    grads: dict[str, int]
    """Gradients per unit (0 on the device with CPU offload)."""
    unsharded_grads: dict[str, int]
    """Gradients as backward produces them, before they reach their final sharded fp32 form: FSDP's
    unsharded param_dtype gradients, or autocast's low-precision weight gradients."""
    reduce_buffers: dict[str, int]
    """FSDP's reduce_dtype copy of a unit's unsharded gradients for the reduce-scatter."""
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
    block_units: tuple[str, ...]
    """The blocks' units, in forward order (ParallelPlan.fsdp_units)."""
    embedding_unit: str | None
    """The embedding's unit (None: a tied embedding lives in the root)."""
    head_units: tuple[str, ...]
    """The units gathered with the head: the head (norm + output) and/or the root when it holds parameters
    (a tied embedding lives there)."""


@dataclass(frozen=True)
class Moment:
    name: str
    parts: dict[str, int]
    """Bytes allocated at this moment, by what holds them."""

    @property
    def nbytes(self) -> int:
        return sum(self.parts.values())


def step_moments(z: StepSizes) -> list[Moment]:
    n = len(z.block_plan)
    blocks = list(z.block_units)
    embedding = [z.embedding_unit] if z.embedding_unit is not None else []
    all_grads = sum(z.grads.values())
    root = [u for u in z.head_units if u == ROOT_UNIT]

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
    common = {"persistent": z.persistent, "autocast weight copies": z.autocast_copies}
    head = list(z.head_units)

    def reducing(units: list[str]) -> dict[str, int]:
        return {"unsharded gradients": sum(z.unsharded_grads.get(u, 0) for u in units),
                "reduce-scatter buffers": sum(z.reduce_buffers.get(u, 0) for u in units)}

    moments = [
        Moment("loss", {**common, "activations": sum(saved) + z.head_saved, "loss": z.loss_transient,
                        "FSDP gathered": gathered(kept_after_forward), "gradients": grads_done([])}),
        Moment("output backward", {
            **common, "activations": sum(saved), "logits gradient": z.logits_grad,
            "unsharded gradients": sum(z.unsharded_grads.get(u, 0) for u in head),
            "FSDP gathered": gathered(head + blocks[-1:]), "gradients": grads_done([]),
        }),
        Moment("head reduce-scatter", {**common, "activations": sum(saved), **reducing(head),
                                       "FSDP gathered": gathered(head + blocks[-1:]), "gradients": grads_done(head)}),
    ]
    for i in reversed(range(n)):
        # Block i computes while the next unit to run backward (block i-1, or the embedding) is prefetched;
        # a tied root stays gathered until its own post-backward at the very end.
        prefetched = blocks[i - 1 : i] if i > 0 else embedding
        units = [blocks[i], *prefetched, *root]
        moments.append(Moment(f"block {i} backward", {
            **common, "activations": sum(saved[: i + 1]), "recompute": z.block_plan[i][1],
            "block working set": z.block_working, "FSDP gathered": gathered(units),
            "gradients": grads_done(head + blocks[i + 1:]),
        }))
        moments.append(Moment(f"block {i} reduce-scatter", {
            **common, "activations": sum(saved[:i]), **reducing([blocks[i]]), "FSDP gathered": gathered(units),
            "gradients": grads_done(head + blocks[i:]),
        }))
    moments.append(Moment("embedding backward", {
        **common, **reducing(embedding), "FSDP gathered": gathered(embedding + root),
        "gradients": all_grads,
    }))
    moments.append(Moment("optimizer step", {"persistent": z.persistent, "gradients": all_grads,
                                             "optimizer scratch": z.optimizer_scratch}))
    return moments
