"""Optimizers: one Adam/AdamW per model part behind a single container the loop steps.

The container is what the training loop, the LR scheduler, the FP16 grad scaler and the checkpoint
manager all talk to:

- ``step()`` / ``zero_grad()`` run every part's optimizer;
- iterating it (``for opt in optimizers``) yields the plain ``torch.optim.Optimizer`` objects, which is
  what ``LambdaLR`` and ``GradScaler.unscale_/step`` need;
- ``state_dict()`` / ``load_state_dict()`` use ``torch.distributed.checkpoint.state_dict`` with
  flattened keys (``state.<param fqn>.exp_avg``, ``param_groups.<param fqn>.lr``), so the same code
  saves plain modules and FSDP2/TP DTensor parameters, and the checkpoint reshards on load.

Low-bit states (``low_bit``) swap torch's AdamW for torchao's AdamW8bit / AdamW4bit / AdamWFp8, which
keep both moments block-quantised (8-bit, 4-bit or float8 e4m3 codes plus one fp32 scale per block)
instead of fp32: 2, 1 and 2 bytes of state per parameter instead of 8, the optimizer half of an
MS-AMP-O2-style memory saving (the master weights stay in the parameter dtype). torchao compiles its
update with ``torch.compile`` per parameter shape (the first step takes seconds, longer on CPU) and,
like bitsandbytes, keeps fp32 state for tensors with fewer than 4096 elements or a size that is not a
multiple of its quantisation block.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from torchtitan_lite.config import Configurable

logger = logging.getLogger("torchtitan_lite")

OptimizerName = Literal["AdamW", "Adam"]
Implementation = Literal["auto", "fused", "foreach", "for-loop"]
LowBit = Literal["adamw8bit", "adamw_fp8", "adamw4bit"]

# torchao.optim class per low-bit choice.
_LOW_BIT_CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8"}

# Flattened keys are what make optimizer state reshardable and independent of param-group order.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

StepPostHook = Callable[[torch.optim.Optimizer, tuple, dict], None]


class OptimizersContainer(Configurable):
    """One optimizer per model part, stepped, zeroed, hooked and checkpointed together."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        name: OptimizerName = "AdamW"
        """AdamW (decoupled weight decay) or Adam (weight_decay is an L2 term added to the gradient)."""
        lr: float = 8e-4
        """Peak learning rate; the LR schedule scales it (warmup, decay)."""
        betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
        """Adam (beta1, beta2): decay rates of the first and second moment estimates."""
        eps: float = 1e-8
        """Adam denominator epsilon."""
        weight_decay: float = 0.1
        """Weight decay coefficient (see no_decay_norms_and_embeddings for which params get it)."""
        no_decay_norms_and_embeddings: bool = True
        """Exempt 1-D params (norm scales, biases) and nn.Embedding weights from weight decay."""
        implementation: Implementation = "auto"
        """torch kernel: 'fused' (one kernel for all params), 'foreach' (batched ops), 'for-loop'
        (per param), or 'auto' = fused where the torch build supports the params' device and dtype,
        else foreach. Must stay 'auto' with low_bit (torchao compiles its own update)."""
        low_bit: LowBit | None = None
        """Quantised AdamW states from torchao: 'adamw8bit' (2 B/param), 'adamw_fp8' (float8 e4m3,
        2 B/param, CUDA needs compute capability >= 8.9), 'adamw4bit' (1 B/param); None keeps fp32
        states (8 B/param). Requires name='AdamW'."""

        def __post_init__(self) -> None:
            _check_choice("optimizer.name", self.name, OptimizerName)
            _check_choice("optimizer.implementation", self.implementation, Implementation)
            if self.low_bit is not None:
                _check_choice("optimizer.low_bit", self.low_bit, LowBit)
            if not self.lr > 0:
                raise ValueError(f"optimizer.lr must be > 0, got {self.lr}; use e.g. --optimizer.lr 3e-4")
            if len(self.betas) != 2:
                raise ValueError(
                    f"optimizer.betas must have exactly 2 values (beta1, beta2), got {list(self.betas)}; "
                    f"use e.g. --optimizer.betas '[0.9, 0.95]'"
                )
            for i, beta in enumerate(self.betas):
                if not 0.0 <= beta < 1.0:
                    raise ValueError(f"optimizer.betas[{i}] must be in [0, 1), got {beta}; typical: 0.9, 0.95")
            if not self.eps >= 0:
                raise ValueError(f"optimizer.eps must be >= 0, got {self.eps}; the usual value is 1e-8")
            if not self.weight_decay >= 0:
                raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}; use 0 to disable it")
            if self.low_bit is not None and self.name != "AdamW":
                raise ValueError(
                    f"optimizer.low_bit={self.low_bit!r} is an AdamW implementation but optimizer.name="
                    f"{self.name!r}; set optimizer.name='AdamW' or optimizer.low_bit=None"
                )
            if self.low_bit is not None and self.implementation != "auto":
                raise ValueError(
                    f"optimizer.implementation={self.implementation!r} selects a torch kernel, but "
                    f"optimizer.low_bit={self.low_bit!r} uses torchao's compiled update; leave "
                    f"optimizer.implementation='auto' or set optimizer.low_bit=None"
                )

    config: OptimizersContainer.Config

    def __init__(self, config: OptimizersContainer.Config, *, model_parts: list[nn.Module]) -> None:
        self.config = config
        if not model_parts:
            raise ValueError("OptimizersContainer needs at least one model part, got an empty model_parts list")
        self.model_parts = list(model_parts)
        self.optimizers: list[torch.optim.Optimizer] = [self._build_one(part) for part in self.model_parts]

    # ----------------------------------------------------------------------------------------------
    # Construction

    def _build_one(self, part: nn.Module) -> torch.optim.Optimizer:
        cfg = self.config
        groups = _split_dtensor_and_plain(_param_groups(part, cfg.weight_decay, cfg.no_decay_norms_and_embeddings))
        params = [p for g in groups for p in g["params"]]
        if not params:
            raise ValueError(f"model part {type(part).__name__} has no trainable parameters to optimize")
        common: dict[str, Any] = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        if cfg.low_bit is not None:
            _check_low_bit_supported(cfg.low_bit, params)
            import torchao.optim

            cls = getattr(torchao.optim, _LOW_BIT_CLASSES[cfg.low_bit])
            optimizer = cls(groups, **common)
            logger.info("optimizer: torchao %s (%s), %d params", cls.__name__, cfg.low_bit, len(params))
            return optimizer
        kernel = _kernel_flags(cfg.implementation, params)
        cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        optimizer = cls(groups, **common, **kernel)
        logger.info("optimizer: %s %s, %d params", cfg.name,
                    "fused" if kernel.get("fused") else "foreach" if kernel.get("foreach") else "for-loop", len(params))
        return optimizer

    # ----------------------------------------------------------------------------------------------
    # What the loop calls

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook: StepPostHook) -> _Handles:
        """Call ``hook(optimizer, args, kwargs)`` after every ``step()`` of each part's optimizer.

        The hook is registered on the torch optimizers themselves, so it also runs when something
        else steps them (``GradScaler.step``); it does not run for a step the scaler skips on
        overflow, since the weights did not change. With several model parts it runs once per part.
        Returns a handle whose ``remove()`` unregisters it everywhere.
        """
        return _Handles([opt.register_step_post_hook(hook) for opt in self.optimizers])

    def lrs(self) -> list[float]:
        """Current learning rate of each part's optimizer (first param group; all groups share it)."""
        return [float(opt.param_groups[0]["lr"]) for opt in self.optimizers]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def state_nbytes(self) -> int:
        """Bytes held by this rank's optimizer states (quantised codes and scales counted as stored)."""
        return sum(
            _tensor_nbytes(value)
            for opt in self.optimizers
            for state in opt.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Flattened state of all parts, keyed by parameter FQN.

        On an optimizer that has not stepped yet, ``get_optimizer_state_dict`` first creates the state
        with one zero-gradient, zero-lr step, which also runs the step post-hooks.
        """
        merged: dict[str, Any] = {}
        for index, (part, opt) in enumerate(zip(self.model_parts, self.optimizers)):
            part_state = get_optimizer_state_dict(part, opt, options=_FLAT)
            clash = next((key for key in part_state if key in merged), None)
            if clash is not None:
                raise ValueError(
                    f"optimizer state key {clash!r} of model part {index} is also used by an earlier part; "
                    f"model parts must keep their parameters' names in the full model (as pipeline stages do)"
                )
            merged.update(part_state)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part picks the keys of its own parameters out of the flat dict.
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, optim_state_dict=state_dict, options=_FLAT)


class _Handles:
    """Removable handle over one hook registered on several optimizers."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _param_groups(part: nn.Module, weight_decay: float, exempt_norms_and_embeddings: bool) -> list[dict]:
    trainable = [p for p in part.parameters() if p.requires_grad]
    if not exempt_norms_and_embeddings or weight_decay == 0:
        return [{"params": trainable}]
    embedding_params = {
        id(p) for m in part.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    # ndim is the global (unsharded) rank for DTensor params, so sharding does not change the split.
    no_decay = [p for p in trainable if p.ndim < 2 or id(p) in embedding_params]
    no_decay_ids = {id(p) for p in no_decay}
    decay = [p for p in trainable if id(p) not in no_decay_ids]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _split_dtensor_and_plain(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensor and its plain-tensor parameters.

    Fused and foreach kernels take one list per call and refuse to mix DTensor with plain tensors;
    tensor parallelism without sequence parallelism leaves the norms' weights plain beside sharded
    Linear weights.
    """
    split = []
    for group in groups:
        for is_dtensor in (True, False):
            params = [p for p in group["params"] if isinstance(p, DTensor) == is_dtensor]
            if params:
                split.append({**group, "params": params})
    return split


def _kernel_flags(implementation: str, params: list[torch.Tensor]) -> dict[str, Any]:
    fused_devices = _get_fused_kernels_supported_devices()
    unsupported = [p for p in params if p.device.type not in fused_devices or not torch.is_floating_point(p)]
    if implementation == "fused" and unsupported:
        p = unsupported[0]
        raise ValueError(
            f"optimizer.implementation='fused' is not supported by this torch build for a {p.dtype} parameter "
            f"on {p.device.type} (fused devices: {fused_devices}, floating-point only); use "
            f"optimizer.implementation='auto' or 'foreach'"
        )
    if implementation == "auto":
        implementation = "foreach" if unsupported else "fused"
    return {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for-loop": {"foreach": False},
    }[implementation]


def _check_low_bit_supported(low_bit: str, params: list[torch.Tensor]) -> None:
    if low_bit != "adamw_fp8":
        return
    for device in {p.device for p in params if p.device.type == "cuda"}:
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"optimizer.low_bit='adamw_fp8' needs float8 support (CUDA compute capability >= 8.9), but "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; use "
                f"optimizer.low_bit='adamw8bit' for the same memory saving"
            )


def _tensor_nbytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        inner_names, _ = t.__tensor_flatten__()
        return sum(_tensor_nbytes(getattr(t, name)) for name in inner_names)
    return t.numel() * t.element_size()


def _check_choice(field_name: str, value: Any, literal: Any) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"{field_name} must be one of {list(choices)}, got {value!r}")
