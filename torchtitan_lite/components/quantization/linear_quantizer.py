"""What every low-precision Linear recipe (float8, MX, the next one) shares: the plan, the swap, the table.

A recipe's converter subclasses ``LinearQuantizer`` and supplies its config (which satisfies
``PlannedConverterConfig``: recipe name, ``filter_fqns``, the high-precision edges, its shape rule), the swap
of the planned Linears, a line of its settings, and the answers the memory estimate asks for (what the
converted Linears cast from, what FSDP and TP move), so that nothing outside this package needs to know
which recipe it is.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch.nn as nn

from torchtitan_lite.components.quantization.float8_plan import (
    PlannedConverterConfig,
    PlanRow,
    float8_plan,
    format_float8_plan,
)
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConverter


class LinearQuantizer(ModelConverter):
    """Swaps the ``nn.Linear`` layers its plan (float8_plan.py) converts for a low-precision twin."""

    def __init__(self, config: ModelConverter.Config, *, context: ConversionContext) -> None:
        super().__init__(config, context=context)
        self.plan: list[PlanRow] | None = None
        """The rows of the last ``convert``."""

    # ----------------------------------------------------------------------------------------------
    # What a recipe supplies

    def swap(self, model: nn.Module, planned: set[str]) -> None:
        """Replace the Linears named in ``planned`` (FQNs) of ``model`` in place."""
        raise NotImplementedError

    def settings(self) -> str:
        """The recipe and its options in a few words, for the head of the plan table."""
        raise NotImplementedError

    @property
    def casts_master_weight(self) -> bool:
        """A converted Linear casts the high-precision master weight itself (True), or takes the compute-dtype
        copy autocast makes of it, as a plain Linear does (False)."""
        raise NotImplementedError

    @property
    def all_gather_itemsize(self) -> int | None:
        """Bytes per element FSDP all-gathers a converted weight in; None: the parameter dtype's. Only when the
        run shards with FSDP."""
        return None

    @property
    def all_gather_why(self) -> str:
        """What FSDP gathers the converted weights as, in a few words (the estimate's all-gather line)."""
        if self.all_gather_itemsize is not None:
            return f"{self.all_gather_itemsize} byte(s) per element"
        return "the recipe quantizes the weight after the gather"

    def all_gather_per_linear(self, rows: list[PlanRow]) -> dict[str, tuple[float | None, str]]:
        """Converted Linear FQN -> (bytes per element FSDP all-gathers its weight in, None for the parameter
        dtype's; why). Asked only when the run shards with FSDP."""
        size = self.all_gather_itemsize
        return {row.fqn: (None if size is None else float(size), self.all_gather_why)
                for row in rows if row.recipe is not None}

    @property
    def float8_tp_communication(self) -> bool:
        """Tensor parallelism moves float8 activations into a region whose consumers are all converted."""
        return False

    # ----------------------------------------------------------------------------------------------
    # Converter protocol

    @property
    def plan_config(self) -> PlannedConverterConfig:
        """The config's plan fields (every recipe's Config has them)."""
        return cast(PlannedConverterConfig, self.config)

    def plan_rows(self, model: nn.Module) -> list[PlanRow]:
        return float8_plan(model, self.plan_config, output_module=self.context.output_module,
                           blocks=self.context.blocks)

    def convert(self, model: nn.Module) -> None:
        """Swap the planned Linears of ``model`` (in place) for the recipe's low-precision Linears."""
        if isinstance(model, nn.Linear):
            raise ValueError(f"the {self.kind} converter swaps Linears inside a model in place; pass the parent module")
        self.plan = self.plan_rows(model)
        # The launch log gets a summary (fp8_plan_summary); the full table is --print-fp8-plan's.
        self.swap(model, {row.fqn for row in self.plan if row.recipe is not None})

    def post_optimizer_hook(self, model_parts: Sequence[nn.Module]) -> None:
        """Nothing to refresh unless the recipe keeps state across steps."""

    def explain(self, model: nn.Module, *, seq_len: int | None = None,
                total_flops_per_token: float | None = None, expert_fp8_flops_per_token: float = 0.0) -> str:
        """The plan of ``model`` as a table, with the FP8 share of training FLOPs.

        ``seq_len`` defaults to training.seq_len; ``total_flops_per_token`` (forward + backward) to
        ``model.flops_per_token(seq_len)`` when the model has it, else the share is of Linear FLOPs only.
        """
        rows = self.plan_rows(model)
        seq_len = self.context.seq_len if seq_len is None else seq_len
        flops_fn = getattr(model, "flops_per_token", None)
        if total_flops_per_token is None and callable(flops_fn):
            total_flops_per_token = flops_fn(seq_len)
        text = f"{self.kind} converter ({self.settings()})\n" + format_float8_plan(
            rows, seq_len=seq_len, total_flops_per_token=total_flops_per_token,
            expert_fp8_flops_per_token=expert_fp8_flops_per_token)
        parts_fn = getattr(model, "high_precision_parts", None)
        parts = parts_fn() if callable(parts_fn) else []
        if parts:
            text += "\nkept in high precision by the model:\n" + "\n".join(f"  {part}: {why}" for part, why in parts)
        return text

    @property
    def kind(self) -> str:
        return self.config.kind


def replace_linears(model: nn.Module, planned: set[str], make: Callable[[nn.Linear], nn.Module]) -> None:
    """Put ``make(linear)`` in the place of each Linear of ``model`` whose FQN is in ``planned``."""
    for fqn in planned:
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        setattr(parent, name, make(getattr(parent, name)))
