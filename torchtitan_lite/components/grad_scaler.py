"""Loss scaling for FP16 training that works with sharded (DTensor) gradients.

FP16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by a large
scale before backward so gradients stay representable, and divided out again before clipping and
the optimizer step. When the scale is too large some gradient overflows to inf/nan: that step is
skipped on every rank.

The scale itself follows Megatron-LM's ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py):

- every overflow skips the step, zeroes the growth tracker and takes one off the hysteresis tracker;
  the scale backs off (``scale = max(scale * backoff_factor, min_scale)``) only once that tracker
  has reached 0. The tracker is not refilled by clean steps: it counts overflows since the scale
  last grew, so with ``hysteresis=2`` the first overflow after a growth only skips, and every
  further one (clean steps in between or not) backs off until the scale grows again;
- after ``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor``
  and the hysteresis tracker is refilled.

``hysteresis=1`` is ``torch.amp.GradScaler``'s rule (back off at every overflow). A static scaler
(``dynamic=False``) never changes the scale, but an overflow still skips the step (Megatron's
``ConstantGradScaler`` with its optimizer's skip).

``torch.amp.GradScaler`` checks only the gradients a rank holds; with FSDP each rank holds a
different shard, so one rank could see an overflow that the others do not and the ranks would
diverge. Here the overflow flag is all-reduced (MAX) so all ranks skip together.

Usage per step (the trainer does exactly this)::

    scaler.scale(loss).backward()      # once per micro-batch
    scaler.unscale_(optimizers)        # before gradient clipping
    clip_grad_norm_(...)
    stepped = scaler.step(optimizers)  # skips the optimizer when a gradient is inf/nan
    scaler.update()                    # adapts the scale
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


class GradScaler:
    """Loss scaler: skips overflowing steps; a dynamic one backs the scale off (after ``hysteresis``
    overflows, never below ``min_scale``) and grows it after ``growth_interval`` clean steps.

    ``optimizers`` arguments are anything with ``param_groups`` and ``step()`` (a torch optimizer or
    the ``OptimizersContainer``), or a list of those.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        hysteresis: int = 1,
        dynamic: bool = True,
        device: torch.device | str = "cpu",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if (init_scale <= 0 or growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1
                or not 0.0 < min_scale <= init_scale or hysteresis < 1):
            raise ValueError(
                f"invalid loss-scaler settings init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}, growth_interval={growth_interval}, min_scale={min_scale}, "
                f"hysteresis={hysteresis}: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                f"growth_interval >= 1, 0 < min_scale <= init_scale and hysteresis >= 1"
            )
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.dynamic = dynamic
        # The overflow flag is all-reduced on this device (NCCL needs CUDA tensors even when the
        # gradients themselves were offloaded to CPU).
        self.device = torch.device(device)
        # None means the default group (every rank) once a process group exists.
        self.process_group = process_group
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis
        self._skipped_steps = 0
        self._found_inf: bool | None = None  # set by unscale_, cleared by update

    # ----------------------------------------------------------------------------------------------
    # Per-step API

    @property
    def scale_value(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def hysteresis_left(self) -> int:
        """Overflows still allowed before the scale backs off (refilled to ``hysteresis`` when it grows)."""
        return self._hysteresis_tracker

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because a gradient overflowed."""
        return self._skipped_steps

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss by the current scale (call ``backward()`` on the result)."""
        return loss * self._scale

    def unscale_(self, optimizers: Any) -> bool:
        """Divide every gradient by the scale in place and find out whether any rank overflowed.

        Returns True when some gradient on some rank of the process group is inf/nan. Must be called
        at most once between two ``update()`` calls (a second division would corrupt the gradients).
        """
        if self._found_inf is not None:
            raise RuntimeError("GradScaler.unscale_() was already called for this step; call update() first")
        local_found = torch.zeros((), dtype=torch.float32, device=self.device)
        for (device, _dtype), grads in _group_local_grads(_params(optimizers)).items():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            inv_scale = torch.full((1,), 1.0 / self._scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
            local_found = torch.maximum(local_found, found.to(self.device).squeeze(0))
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local_found, op=dist.ReduceOp.MAX, group=self.process_group)
        self._found_inf = bool(local_found.item() > 0)
        return self._found_inf

    def step(self, optimizers: Any) -> bool:
        """Run the optimizer step unless a gradient overflowed; returns whether it stepped."""
        if self._found_inf is None:
            self.unscale_(optimizers)
        if self._found_inf:
            self._skipped_steps += 1
            return False
        for optimizer in _as_list(optimizers):
            optimizer.step()
        return True

    def update(self) -> None:
        """Adapt the scale after a step (dynamic only): back off once the hysteresis is used up, grow
        after ``growth_interval`` clean steps in a row."""
        if self._found_inf is None:
            raise RuntimeError("GradScaler.update() called without unscale_()/step() for this step")
        found_inf, self._found_inf = self._found_inf, None
        if not self.dynamic:
            if found_inf:
                logger.info("FP16 gradient overflow: step skipped (%d so far), static loss scale %g",
                            self._skipped_steps, self._scale)
            return
        if not found_inf:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale *= self.growth_factor
            return
        self._growth_tracker = 0
        self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
        old = self._scale
        if self._hysteresis_tracker <= 0:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        if old == self.min_scale and self._hysteresis_tracker <= 0:
            logger.warning("FP16 gradient overflow at the minimum loss scale %g (precision.min_scale): step skipped "
                           "(%d so far). Gradients overflow even at this scale: lower optimizer.lr, enable clipping "
                           "(training.max_norm) or use precision.param_dtype=bfloat16", old, self._skipped_steps)
        elif self._scale != old:
            logger.info("FP16 gradient overflow: step skipped (%d so far), loss scale %g -> %g",
                        self._skipped_steps, old, self._scale)
        else:
            logger.info("FP16 gradient overflow: step skipped (%d so far), loss scale stays %g (hysteresis: %d more "
                        "overflow(s) before it backs off)", self._skipped_steps, old, self._hysteresis_tracker)

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    OPTIONAL_STATE_KEYS = ("hysteresis_tracker",)
    """Keys that checkpoints of earlier releases lack; loading goes on without them (see load_state_dict)."""

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker, "skipped_steps": self._skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume exactly where the saved scaler stopped. A static scaler keeps its configured scale (the
        config decides it; only the skip count carries over); a hysteresis tracker above this run's
        ``hysteresis`` is capped to it."""
        self._skipped_steps = int(_as_number(state_dict["skipped_steps"]))
        self._found_inf = None
        saved_scale = float(_as_number(state_dict["scale"]))
        if not self.dynamic:
            if saved_scale != self._scale:
                logger.info("static loss scale %g from the config; the checkpoint's scale %g is not used",
                            self._scale, saved_scale)
            return
        self._scale = saved_scale
        self._growth_tracker = int(_as_number(state_dict["growth_tracker"]))
        # Checkpoints written before hysteresis existed lack the counter: they had none, so it starts full.
        saved_tracker = state_dict.get("hysteresis_tracker", self.hysteresis)
        self._hysteresis_tracker = min(int(_as_number(saved_tracker)), self.hysteresis)


def _as_number(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else value


def _as_list(optimizers: Any) -> list[Any]:
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def _params(optimizers: Any) -> Iterator[torch.nn.Parameter]:
    seen: set[int] = set()
    for optimizer in _as_list(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def _group_local_grads(params: Iterable[torch.nn.Parameter]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    # A DTensor gradient is checked and unscaled through its local shard: the shard is a view of the
    # DTensor's storage, so the in-place division updates the DTensor itself.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        groups[(grad.device, grad.dtype)].append(grad)
    return groups
