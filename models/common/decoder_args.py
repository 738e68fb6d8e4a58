"""The model arguments the shared decoder parts read; every family's args dataclass provides them."""
from __future__ import annotations

from typing import Protocol

from torchtitan_lite.protocols.model_shape import ModelShape


class DecoderArgs(ModelShape, Protocol):
    """Read-only view of a family's model args (fields or properties): the shape the core reads
    (``ModelShape``), and what the decoder skeleton builds and initialises from."""

    @property
    def rope_theta(self) -> float: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def depth_init(self) -> bool: ...
