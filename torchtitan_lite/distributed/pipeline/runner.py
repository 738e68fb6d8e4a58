"""One pipeline step: the local batch cut into micro-batches, run through this rank's stages by the schedule.

The schedule runs the backward itself, so what the trainer would do around ``loss.backward()`` happens in the
loss function handed to it: each micro-batch's loss is normalised by the step's global target-token count
(the same ``sum / global tokens`` as without a pipeline, so gradients match a 1-process run), the MoE
auxiliary loss is not involved (it enters through the blocks, models/common/moe/aux_loss_grad.py), and the
objective is scaled by the FP16 loss scaler when there is one. Gradients are not rescaled by the schedule
(``scale_grads=False``): the normalisation above already makes them the global mean.

Only the rank holding the last stage sees losses; ``step`` returns their sum there and zero elsewhere, and
the trainer sums it over the pipeline group (``loss_group``) so that every rank logs, checks and judges the same
loss.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from torchtitan_lite.distributed.pipeline.layout import PipelineLayout
from torchtitan_lite.distributed.step_runner import LossFn, ModelKwargs
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.placeholder_forward import in_placeholder_forward, placeholder_forward


class PipelineRunner:
    """The step runner (distributed/step_runner.py) of a rank holding pipeline stages."""

    def __init__(self, layout: PipelineLayout, modules: list[BaseModel], stage_ids: tuple[int, ...], *,
                 group: dist.ProcessGroup, device: torch.device, loss_fn: LossFn) -> None:
        self.layout = layout
        self.stage_ids = stage_ids
        self.loss_fn = loss_fn
        self.stages = [_Stage(module, stage_id, layout.n_stages, device, group=group)
                       for module, stage_id in zip(modules, stage_ids, strict=True)]
        self.holds_first = 0 in stage_ids
        self.holds_last = layout.n_stages - 1 in stage_ids
        self.forwards_per_batch = layout.n_microbatches
        self.loss_group: dist.ProcessGroup | None = group
        """Only the last stage's rank computes the loss: the trainer and the validator share it over the pipeline."""
        schedule_cls = getattr(pipelining, layout.facts.torch_class)
        stages = self.stages if layout.facts.looped else self.stages[0]
        self.schedule = schedule_cls(stages, n_microbatches=layout.n_microbatches, loss_fn=self._loss,
                                     scale_grads=False)
        self._guard_shape_inference(modules)
        # Set for the duration of one step / eval by ``step`` and ``eval``.
        self._global_tokens: torch.Tensor | None = None
        self._objective: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self._sums: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, *, global_tokens: torch.Tensor,
             objective: Callable[[torch.Tensor], torch.Tensor] | None = None,
             model_kwargs: ModelKwargs | None = None) -> torch.Tensor:
        """Forward and backward of one local batch through the pipeline, gradients accumulated into the
        stages' parameters. ``objective`` maps a micro-batch's normalised loss to what is differentiated
        (the FP16 scaler's scaling); returns the batch's normalised loss sum on the last stage's rank, zero
        elsewhere."""
        self._global_tokens = global_tokens
        self._objective = objective or (lambda loss: loss)
        self._run(self.schedule.step, inputs, labels, model_kwargs)
        losses = [s / global_tokens for s in self._sums]
        return torch.stack(losses).sum() if losses else torch.zeros((), device=global_tokens.device)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, labels: torch.Tensor,
             model_kwargs: ModelKwargs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only: (summed loss, target tokens) of the batch on the last stage's rank, zeros elsewhere."""
        self._global_tokens = None
        self._run(self.schedule.eval, inputs, labels, model_kwargs)
        if not self._sums:
            zero = torch.zeros((), device=labels.device)
            return zero, zero
        return torch.stack(self._sums).sum(), torch.stack(self._tokens).sum()

    def _run(self, call: Callable[..., object], inputs: torch.Tensor, labels: torch.Tensor,
             model_kwargs: ModelKwargs | None) -> None:
        self._sums, self._tokens = [], []
        args = (inputs,) if self.holds_first else ()
        target = labels if self.holds_last else None
        # Keyword tensors (the sequence layout) go to every stage: the schedule splits them by micro-batch as it
        # splits the inputs, and each stage's forward builds its own attention mask from them.
        call(*args, target=target, return_outputs=False, **(model_kwargs or {}))
        if self.holds_last and len(self._sums) != self.layout.n_microbatches:
            raise RuntimeError(f"the pipeline schedule computed {len(self._sums)} losses for "
                               f"{self.layout.n_microbatches} micro-batches")

    def _guard_shape_inference(self, modules: list[BaseModel]) -> None:
        """The schedule learns the stages' input and output shapes by running each stage's forward once on
        placeholder tensors before the first real micro-batch: torch 2.13 also runs the loss and the backward to the
        inputs (the first micro-batch detached, uninitialised tensors for the other stages) at the first step and
        after every switch between training and evaluation; torch 2.11 runs only a no-grad forward on zeros, once.
        That pass must leave no trace: its loss is not counted, every buffer (e.g. MoE load counters) gets back
        its value, and the model knows it is a placeholder forward (torchtitan_lite/protocols/placeholder_forward.py).
        torch offers no hook for this: the schedule's own stage-initialisation method, which runs the pass, is
        wrapped (``_stage_initialisation_method`` names it for each torch release).

        torch 2.11 also builds the stages' receive buffers only once, needing gradients or not as the first call
        did (evaluation before the first training step leaves them without: the backward then fails); like torch
        2.13, the wrapper has them rebuilt after a switch between training and evaluation."""
        name = _stage_initialisation_method(self.schedule)
        infer = getattr(self.schedule, name)
        forward_built_flag = _TORCH_2_11_FORWARD_BUILT.get(name)
        built_for_backward: list[bool] = []  # the mode of the last call, once there was one

        def guarded(*args: Any, **kwargs: Any) -> Any:
            has_backward = self.schedule._has_backward
            if forward_built_flag is not None and built_for_backward and built_for_backward[0] != has_backward:
                setattr(self.schedule, forward_built_flag, False)
            built_for_backward[:] = [has_backward]
            with torch.no_grad():
                buffers = [(b, b.clone()) for module in modules for b in module.buffers()]
            with placeholder_forward():
                result = infer(*args, **kwargs)
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)
            return result

        setattr(self.schedule, name, guarded)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss_sum, n_tokens = self.loss_fn(output, target)
        if in_placeholder_forward():
            return loss_sum
        self._sums.append(loss_sum.detach().float())
        self._tokens.append(torch.as_tensor(n_tokens, device=loss_sum.device).float())
        if self._global_tokens is None:  # eval: nothing is differentiated
            return loss_sum
        return self._objective(loss_sum / self._global_tokens)


# The private schedule method that runs the shape-inference pass before the first micro-batch, newest torch first:
# torch 2.13 shares one for every schedule; torch 2.11 has one for single-stage schedules (1F1B) and another for
# multi-stage ones (Interleaved1F1B, ZBVZeroBubble, DualPipeV), both calling each stage's _prepare_forward_infra.
_STAGE_INITIALISATION_METHODS = ("_initialize_pp_stages", "_initialize_stages", "_initialize_stage")
# torch 2.11's flag, per method, saying that the stages' forward side (receive buffers included) is built.
_TORCH_2_11_FORWARD_BUILT = {"_initialize_stages": "_stages_forward_initialized",
                             "_initialize_stage": "_stage_forward_initialized"}


def _stage_initialisation_method(schedule: object) -> str:
    for name in _STAGE_INITIALISATION_METHODS:
        if callable(getattr(schedule, name, None)):
            return name
    raise RuntimeError(f"torch {torch.__version__}'s {type(schedule).__name__} has none of the stage-initialisation "
                       f"methods {_STAGE_INITIALISATION_METHODS} that the pipeline's shape-inference guard wraps; "
                       f"torch 2.11 to 2.14 is supported")


class _Stage(pipelining.PipelineStage):
    """A PipelineStage that V schedules can also evaluate: torch's runtime hands the input gradient from a
    rank's stage to its other, adjacent stage even in ``eval``, where no stage has a backward (torch 2.13
    raises "can't steal_bwd_input if this stage doesn't have backward"). Without a backward there is nothing
    to hand over.

    And one whose communication warm-up skips its neighbours on the same rank: torch 2.11 warms the pipeline's
    links up by sending a dummy tensor to every neighbouring stage, the rank itself included when a V schedule
    puts two adjacent stages on it, and gloo has no link from a rank to itself ("Pair is not connected").
    Adjacent stages on one rank hand their tensors over directly, so there is no link to warm up (torch 2.13
    warms up through a vote that leaves them out and does not call this)."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)
