"""Device memory of one pipeline rank at the moments of a pipeline step where its peak can occur.

A pipeline rank runs the forward and backward of many micro-batches interleaved (distributed/pipeline/
in_flight.py says how many it holds at once), so the moments differ from memory/timeline.py's:

- loss backward (the rank holding the last stage): the most micro-batch activations the rank holds at once
  (each weighed by its stage's bytes), plus the loss backward's gradients of one micro-batch;
- block backward: the same held activations less the part of the backpropagated micro-batch its backward
  has already freed before reaching a block (the stage output, or the last stage's logits, loss graph and
  head; the smallest over the rank's stages), plus the largest block's recomputation and activation
  gradients with its unit's fresh gradients;
- gradient reduce-scatter: torch's REDUCE_GRAD action after the last backward of each stage: the
  accumulated gradients and one unit's reduce_dtype copy for the reduce-scatter;
- optimizer step: every sharded gradient plus the optimizer's scratch.

What a pipeline keeps for the whole step (torch/distributed/pipelining/stage.py, schedules.py, torch 2.13):

- receive buffers: every stage but the first allocates one buffer per micro-batch for its input
  activations, every stage but the last one per micro-batch for its output's gradient, up front
  (``_setup_forward_recv_info``, ``_create_grad_recv_info``); each is the residual stream of one micro-batch;
- FSDP: the stages keep their weights gathered ('never' resharded after forward, ResolvedRun.
  fsdp_reshard_after_forward), and the schedule runs each backward with gradient sync off
  (``backward_maybe_with_nosync``), so each unit's unsharded gradient accumulates over the micro-batches, in
  reduce_dtype (``FSDPParam.to_accumulated_grad_if_needed``), until REDUCE_GRAD reduce-scatters it into the
  sharded fp32 gradient and reshards the weights (``perform_reduce_grad``). The sharded gradients exist from
  then on, or from the start with gradient accumulation over several local batches;
- without FSDP, autograd accumulates into the (TP-sharded) fp32 .grad from the first backward on.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.memory.timeline import Moment


@dataclass(frozen=True)
class PipelineRankSizes:
    """Byte counts of one pipeline rank (its stages' parts of the model)."""

    persistent: int
    """Parameters, optimizer states and buffers resident on the device."""
    autocast_copies: int
    grads: int
    """Sharded fp32 gradients."""
    fsdp: bool
    accumulating: bool
    """Gradient accumulation over several local batches: the sharded gradients exist all step."""
    gathered: int
    """FSDP-gathered weights held during the step (all the rank's units, never resharded)."""
    accumulated_grads: int
    """FSDP's unsharded gradients, accumulated over the micro-batches in reduce_dtype (0 without FSDP)."""
    reduce_buffer: int
    """The largest unit's reduce_dtype copy for the reduce-scatter (0 without FSDP)."""
    recv_buffers: int
    held_activations: int
    """The most activation bytes of in-flight micro-batches the rank holds at once."""
    freed_before_blocks: int
    """Bytes of the backpropagated micro-batch freed before the backward reaches its stage's blocks."""
    block_transient: int
    """A block's recomputation, activation gradients and fresh unsharded gradients (the largest block)."""
    loss_transient: int
    """The loss backward's gradients of one micro-batch (0: the rank does not hold the last stage)."""
    optimizer_scratch: int


def pipeline_moments(z: PipelineRankSizes) -> list[Moment]:
    common = {"persistent": z.persistent, "autocast weight copies": z.autocast_copies,
              "pipeline receive buffers": z.recv_buffers, "FSDP gathered": z.gathered,
              "accumulated unsharded gradients": z.accumulated_grads}
    during_backward = z.grads if z.accumulating or not z.fsdp else 0
    loss = [Moment("loss backward", {**common, "activations": z.held_activations, "loss": z.loss_transient,
                                     "gradients": during_backward})] if z.loss_transient else []
    return [
        *loss,
        Moment("block backward", {**common, "activations": z.held_activations - z.freed_before_blocks,
                                  "block transient": z.block_transient, "gradients": during_backward}),
        Moment("gradient reduce-scatter", {**common, "reduce-scatter buffers": z.reduce_buffer, "gradients": z.grads}),
        Moment("optimizer step", {"persistent": z.persistent, "pipeline receive buffers": z.recv_buffers,
                                  "gradients": z.grads, "optimizer scratch": z.optimizer_scratch}),
    ]
