"""Toy config tree shared by the config tests (this module holds no tests).

It has the shape of the real root config: sections that are plain dataclasses or nested
``Component.Config`` classes, a section inside a section, and a typed-config list whose base
class offers ``registry()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from torchtitan_lite.config import Configurable


@dataclass(kw_only=True)
class ToyConverterConfig:
    """Base of the toy converter configs."""

    kind: ClassVar[str] = ""
    enabled: bool = True
    """Whether this converter runs."""

    @classmethod
    def registry(cls) -> dict[str, type]:
        return {"scale": ScaleConfig, "quant": QuantConfig}


@dataclass(kw_only=True)
class ScaleConfig(ToyConverterConfig):
    """Multiply every weight by a factor."""

    kind: ClassVar[str] = "scale"
    factor: float = 2.0
    """Multiplier applied to the weights."""

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")


@dataclass(kw_only=True)
class QuantConfig(ToyConverterConfig):
    """Quantize Linear layers."""

    kind: ClassVar[str] = "quant"
    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling recipe."""
    filter_fqns: list[str] = field(default_factory=list)
    """Module names to skip."""


class ToyConverters(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        converters: list[ToyConverterConfig] = field(default_factory=list)
        """Converters applied in order."""
        print_after_conversion: bool = False
        """Print the model after converting it."""

        def __post_init__(self) -> None:
            kinds = [c.kind for c in self.converters]
            if len(set(kinds)) != len(kinds):
                raise ValueError(f"model_converters.converters lists a kind twice: {kinds}")


@dataclass(kw_only=True)
class Schedule:
    warmup: int = 3
    """Warm-up steps."""
    ratio: float = 0.5
    """Fraction of the steps spent decaying."""


@dataclass(kw_only=True)
class Training:
    steps: int = 10
    """Optimizer steps."""
    max_norm: float = 1.0
    """Clipping threshold."""
    seed: int | None = 0
    """Random seed; None leaves RNGs unseeded."""
    tag: str | None = None
    """Optional run tag."""
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute mode."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile."""
    sizes: list[int] = field(default_factory=list)
    """Some integer sizes."""
    factors: list[float] = field(default_factory=lambda: [0.5])
    """Some float factors."""
    compile: bool = False
    """Whether to compile."""
    schedule: Schedule = field(default_factory=Schedule)
    """Learning-rate schedule."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"training.steps must be >= 1, got {self.steps}")


class ToyOptimizer(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        name: str = "AdamW"
        """Optimizer class name."""
        lr: float = 3e-4
        """Peak learning rate."""
        eps: float = 1e-8
        """Adam epsilon."""


class ToyTrainer(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        training: Training = field(default_factory=Training)
        """Steps and batch."""
        optimizer: ToyOptimizer.Config = field(default_factory=ToyOptimizer.Config)
        """Optimizer."""
        model_converters: ToyConverters.Config = field(default_factory=ToyConverters.Config)
        """Module swaps."""
