"""Model converters: module swaps applied to the meta-device model before parallelisation.

A converter (e.g. FP8 training via torchao ``Float8Linear``) is configured by a typed entry of
``model_converters.converters``. Each entry's config class declares a ``kind`` (the name used on the
command line, ``--model_converters.converters float8``, and in TOML,
``[[model_converters.converters]] kind = "float8"``); ``ModelConverter.Config.registry()`` maps kinds
to config classes for the parser.

Lifecycle in the trainer::

    converters = cfg.model_converters.build(context=ConversionContext(...))   # once, in resolve_run
    converters.convert(model)                     # meta model, before TP / AC / compile / FSDP
    optimizers.register_step_post_hook(lambda *_: converters.post_optimizer_hook(model_parts))
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from torchtitan_lite.config import Configurable
from torchtitan_lite.mesh import process_groups as dist_utils
from torchtitan_lite.protocols.tp_misfits import TpMisfits, tp_misfits_message

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionContext:
    """The facts of a resolved run that converters check their settings against."""

    device_type: str
    """'cuda' or 'cpu': where the run computes (possibly sized from a host without that device)."""
    param_dtype: torch.dtype
    """The resolved compute dtype ('auto' already decided)."""
    autocast: bool
    """Low precision comes from torch.autocast (no FSDP), not from FSDP's parameter casts."""
    fsdp_sharded: bool
    tp_enabled: bool
    compile_model: bool
    """The transformer blocks are compiled."""
    seq_len: int
    output_module: str
    """FQN of the model's output projection (the family's ParallelPlan.output): converters keep it in high
    precision unless told otherwise."""
    blocks: str
    """Name of the model's block container (the family's ParallelPlan.blocks): the first / last blocks a converter
    keeps in high precision are found there."""
    dp_shard: int = 1
    """FSDP's shard degree (1 without FSDP sharding)."""
    tp: int = 1
    tp_shard_dim: Callable[[str], int | None] = lambda fqn: None
    """The weight dim TP splits for a module FQN (the family's ParallelPlan.tp_shard_dim), None if whole."""
    tokens_per_forward: int = 0
    """Tokens one forward pass of a rank computes (local batch, or a pipeline micro-batch, x seq_len); 0 unknown."""
    ep: int = 1
    """Expert-parallel degree: each rank's experts see the tokens of ``ep`` ranks."""


class ModelConverter(Configurable):
    """Protocol of a converter: ``convert(model)`` in place, ``post_optimizer_hook(model_parts)`` after
    every optimizer step, ``explain(model)`` says what ``convert`` does (or did) to each module."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        kind: ClassVar[str] = ""
        """Name of the converter in CLI/TOML; every concrete converter config sets its own."""
        swaps: ClassVar[str | None] = None
        """Module type the converter replaces (e.g. 'nn.Linear'): two converters swapping the same
        type cannot be combined, since a module can be converted only once."""
        low_precision_experts: ClassVar[bool] = False
        """The converter runs the routed experts' grouped GEMMs in FP8 / MX: the memory estimate then counts
        their float8 operands and the input copy each GEMM saves (memory/routed.py)."""
        _registry: ClassVar[dict[str, type[ModelConverter.Config]]] = {}

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            kind = cls.__dict__.get("kind")
            if not kind:
                return
            known = ModelConverter.Config._registry.get(kind)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise TypeError(f"model converter kind {kind!r} is already used by {known.__module__}.{known.__qualname__}")
            ModelConverter.Config._registry[kind] = cls

        @classmethod
        def registry(cls) -> dict[str, type[ModelConverter.Config]]:
            """Every converter kind -> its config class (the kinds whose modules have been imported)."""
            return dict(ModelConverter.Config._registry)

        def build(self, *, context: ConversionContext) -> ModelConverter:  # type: ignore[override]  # narrows **runtime
            """Build the converter, checking its settings against the run's ``context``."""
            owner = type(self)._owner
            if owner is None:
                raise TypeError(f"{type(self).__qualname__} has no converter class to build")
            converter: ModelConverter = owner(self, context=context)
            return converter

    config: ModelConverter.Config

    def __init__(self, config: ModelConverter.Config, *, context: ConversionContext) -> None:
        self.config = config
        self.context = context

    def convert(self, model: nn.Module) -> None:
        raise NotImplementedError

    def post_optimizer_hook(self, model_parts: Sequence[nn.Module]) -> None:
        raise NotImplementedError

    def explain(self, model: nn.Module) -> str:
        raise NotImplementedError

    def tp_misfits(self, model: nn.Module) -> TpMisfits | None:
        """The modules of ``model`` (not yet converted) whose TP shards this converter's recipe cannot take, or
        None when it has no such rule."""
        return None


class ModelConvertersContainer(Configurable):
    """Applies the configured converters in order and forwards the post-optimizer hook to each."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        converters: list[ModelConverter.Config] = field(default_factory=list)
        """Converters applied in order, e.g. --model_converters.converters float8 or TOML
        [[model_converters.converters]] with kind = "float8" and the converter's fields."""
        print_after_conversion: bool = False
        """Log the model's module tree after conversion (rank 0)."""

        def __post_init__(self) -> None:
            _check_converters(self.converters)

        def build(self, *, context: ConversionContext) -> ModelConvertersContainer:  # type: ignore[override]  # narrows **runtime
            """Build every converter in order."""
            return ModelConvertersContainer(self, context=context)

    config: ModelConvertersContainer.Config

    def __init__(self, config: ModelConvertersContainer.Config, *, context: ConversionContext) -> None:
        self.config = config
        # Checked again: registry functions may append entries after the config was constructed.
        _check_converters(config.converters)
        self.converters = [c.build(context=context) for c in config.converters]

    def check_tp_shards(self, model: nn.Module) -> None:
        """Refuse, naming every module of every converter at once, when tensor parallelism would cut a module
        that its converter cannot run on a shard (``model`` not yet converted)."""
        reports = [(i, report) for i, converter in enumerate(self.converters)
                   if (report := converter.tp_misfits(model)) is not None and report.misfits]
        if reports:
            tp = self.converters[reports[0][0]].context.tp
            raise ValueError(tp_misfits_message(reports, tp=tp))

    def convert(self, model: nn.Module) -> None:
        self.check_tp_shards(model)
        for converter in self.converters:
            converter.convert(model)
        if self.converters and self.config.print_after_conversion and dist_utils.is_rank0():
            logger.info("model after conversion:\n%s", model)

    def post_optimizer_hook(self, model_parts: Sequence[nn.Module]) -> None:
        for converter in self.converters:
            converter.post_optimizer_hook(model_parts)

    def explain(self, model: nn.Module) -> str:
        if not self.converters:
            return "no model converters configured (model_converters.converters is empty)"
        return "\n\n".join(converter.explain(model) for converter in self.converters)


def _check_converters(converters: list[ModelConverter.Config]) -> None:
    swapped_by: dict[str, tuple[int, str]] = {}
    for i, entry in enumerate(converters):
        if not isinstance(entry, ModelConverter.Config) or not type(entry).kind:
            raise ValueError(
                f"model_converters.converters[{i}] is a {type(entry).__name__}, not a converter config; "
                f"use one of: {', '.join(sorted(ModelConverter.Config.registry()))}"
            )
        swaps = type(entry).swaps
        if swaps is None:
            continue
        if swaps in swapped_by:
            j, other = swapped_by[swaps]
            raise ValueError(
                f"model_converters.converters[{j}] ({other}) and [{i}] ({entry.kind}) both convert {swaps} modules, "
                f"and a module can be converted only once; keep one of them"
            )
        swapped_by[swaps] = (i, entry.kind)
