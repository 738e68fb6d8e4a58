"""Learning-rate schedule: linear warmup, optional stable phase, then decay to a floor.

The schedule is a factor of the peak lr (``optimizer.lr``) as a function of the optimizer step ``s``
(1-based: ``s`` is the step about to be taken), for ``T`` training steps, ``W`` warmup steps,
``D`` decay steps and floor ``m = min_lr_factor``::

    s <= W            warmup  f = s / (W + 1)                 (1/(W+1), 2/(W+1), ..., W/(W+1))
    W < s <= T - D    stable  f = 1
    s >  T - D        decay   f = m + (1 - m) * g(p),  p = (s - (T - D)) / D  in (0, 1]

so the peak is reached on the first step after warmup and the last step trains at exactly
``m * lr``. ``g`` is the decay shape: linear ``1 - p``, cosine ``(1 + cos(pi p)) / 2``, and for
``wsd`` the "1 - sqrt" cooldown ``1 - sqrt(p)`` of warmup-stable-decay training (Hägele et al. 2024).
``D`` is ``round(decay_ratio * T)`` (at least 1), or for linear/cosine without a ratio every post-warmup step
(``T - W``); ``constant`` has no decay. Beyond ``T`` the factor stays at the floor.

Each optimizer gets a ``torch.optim.lr_scheduler.LambdaLR`` (so low-bit optimizers with tensor lrs
are updated in place); the loop calls ``step()`` once after each optimizer step.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_lite.config import Configurable

DecayType = Literal["constant", "linear", "cosine", "wsd"]

logger = logging.getLogger(__name__)


class LRSchedulersContainer(Configurable):
    """One LambdaLR per optimizer, all following the same schedule."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        warmup_steps: int = 20
        """Steps of linear warmup: step s (1-based) uses lr * s / (warmup_steps + 1)."""
        decay_type: DecayType = "linear"
        """After warmup: 'constant' (no decay), 'linear' or 'cosine' decay, or 'wsd' (stable, then the
        1 - sqrt cooldown over the last decay_ratio of training)."""
        decay_ratio: float | None = None
        """Fraction of all training steps spent decaying, at the end; the steps between warmup and
        decay are stable at the peak lr. Required for 'wsd'; None for linear/cosine decays over all
        post-warmup steps; must be None for 'constant'."""
        min_lr_factor: float = 0.1
        """Floor of the decay as a fraction of the peak lr (the last step uses lr * min_lr_factor)."""

        def __post_init__(self) -> None:
            if self.decay_type not in get_args(DecayType):
                raise ValueError(
                    f"lr_scheduler.decay_type must be one of {list(get_args(DecayType))}, got {self.decay_type!r}"
                )
            if self.warmup_steps < 0:
                raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
            if not 0.0 <= self.min_lr_factor <= 1.0:
                raise ValueError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")
            if self.decay_ratio is not None and not 0.0 < self.decay_ratio <= 1.0:
                raise ValueError(
                    f"lr_scheduler.decay_ratio must be in (0, 1] or None, got {self.decay_ratio}; "
                    f"e.g. 0.2 decays over the last 20% of training"
                )
            if self.decay_type == "wsd" and self.decay_ratio is None:
                raise ValueError(
                    "lr_scheduler.decay_type='wsd' needs lr_scheduler.decay_ratio (the fraction of training "
                    "spent in the final cooldown), e.g. --lr_scheduler.decay_ratio 0.2"
                )
            if self.decay_type == "constant" and self.decay_ratio is not None:
                raise ValueError(
                    f"lr_scheduler.decay_type='constant' never decays, but lr_scheduler.decay_ratio="
                    f"{self.decay_ratio}; unset decay_ratio or pick decay_type linear, cosine or wsd"
                )

    config: LRSchedulersContainer.Config

    def __init__(self, config: LRSchedulersContainer.Config, *, optimizers: Any, training_steps: int) -> None:
        self.config = config
        self.training_steps = training_steps
        self.warmup_steps, self.decay_steps = _warmup_and_decay_steps(config, training_steps)
        self.lr_factor = functools.partial(
            lr_factor,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            training_steps=training_steps,
            decay_type=config.decay_type,
            min_lr_factor=config.min_lr_factor,
        )
        # LambdaLR passes the number of completed steps; the factor is defined on the next step's number.
        self.schedulers = [LambdaLR(opt, lambda done: self.lr_factor(done + 1)) for opt in optimizers]

    def step(self) -> None:
        """Advance after an optimizer step: sets the lr the next optimizer step will use."""
        for scheduler in self.schedulers:
            scheduler.step()

    @property
    def last_step(self) -> int:
        """Optimizer steps completed so far according to the schedule."""
        return self.schedulers[0].last_epoch

    @property
    def last_lr(self) -> float:
        """The lr the next optimizer step uses (first optimizer, first param group)."""
        return float(self.schedulers[0].optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        # Only the position: the lr values follow from the config, so a resumed run may change
        # optimizer.lr or the schedule and continue from the same step.
        return {"last_step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        done = int(state_dict["last_step"])
        factor = self.lr_factor(done + 1)
        for scheduler in self.schedulers:
            scheduler.last_epoch = done
            for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                _set_lr(group, float(base_lr) * factor)
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    training_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr used by optimizer step ``step`` (1-based); see the module docstring."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    decay_start = training_steps - decay_steps
    if decay_type == "constant" or decay_steps == 0 or step <= decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # wsd
        shape = 1.0 - math.sqrt(progress)
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def _warmup_and_decay_steps(config: LRSchedulersContainer.Config, training_steps: int) -> tuple[int, int]:
    """Warmup and decay lengths for this run; warmup shrinks (with a warning) when the run is shorter.

    A short run of a long-run config (``--training.steps 5``) is a normal thing to ask for, so a
    warmup that does not fit is shortened rather than refused, as torchtitan does.
    """
    if training_steps < 1:
        raise ValueError(f"training.steps must be >= 1 to build an LR schedule, got {training_steps}")
    decay: int | None = 0
    if config.decay_type != "constant":
        decay = None if config.decay_ratio is None else max(1, round(config.decay_ratio * training_steps))
    room = training_steps - (decay or 0)
    warmup = config.warmup_steps
    if warmup > room:
        logger.warning(
            "lr_scheduler.warmup_steps=%s does not fit in training.steps=%s%s; warming up over %s steps",
            warmup, training_steps, f" with {decay} decay steps" if decay else "", max(room, 0),
        )
        warmup = max(room, 0)
    if decay is None:
        decay = training_steps - warmup
    return warmup, decay


def _set_lr(group: dict[str, Any], lr: float) -> None:
    # torchao's low-bit optimizers keep lr as a tensor and require it to stay one.
    if isinstance(group["lr"], Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr
