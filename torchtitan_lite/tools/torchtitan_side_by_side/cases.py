"""The compared cases: precision x compile x layout, each a set of our flags on top of the base config.

The torchtitan side of every case is generated from our config resolved with those flags, so a case
names only what differs from the base; what torchtitan gets is decided in one place (the runner's
``settings_from_config``).
"""
from __future__ import annotations

from dataclasses import dataclass

_BF16 = ("--precision.param_dtype", "bfloat16")
_COMPILE = ("--compile.enable", "true")
_FSDP2 = ("--parallelism.dp_shard", "2")


def _float8(recipe: str) -> tuple[str, ...]:
    # The output projection stays in bfloat16, as in our llama3_debug_fp8* configs.
    return ("--model_converters.converters", "float8", "--model_converters.converters.0.recipe_name", recipe,
            "--model_converters.converters.0.filter_fqns", "output")


@dataclass(frozen=True)
class Case:
    key: str
    """Name on the command line (``--cases``) and in the table."""
    overrides: tuple[str, ...]
    """Our flags on top of the base config (the base's own overrides come first)."""
    float8_recipe: str | None = None
    """The float8 recipe the case needs from torchtitan's converter, if any."""


MATRIX: tuple[Case, ...] = (
    Case("fp32-eager", ()),
    Case("fp32-compile", _COMPILE),
    Case("bf16-eager", _BF16),
    Case("bf16-compile", _BF16 + _COMPILE),
    Case("fp32-eager-fsdp2", _FSDP2),
    Case("fp32-compile-fsdp2", _COMPILE + _FSDP2),
    Case("bf16-eager-fsdp2", _BF16 + _FSDP2),
    Case("bf16-compile-fsdp2", _BF16 + _COMPILE + _FSDP2),
    Case("fp8-rowwise-compile", _BF16 + _COMPILE + _float8("rowwise"), float8_recipe="rowwise"),
    Case("fp8-tensorwise-compile", _BF16 + _COMPILE + _float8("tensorwise"), float8_recipe="tensorwise"),
)
"""Every case ``--matrix`` runs: fp32 / bf16 x eager / compiled x 1 process / FSDP on 2, and FP8 with compile."""

AS_CONFIGURED = Case("as-configured", ())
"""Without ``--matrix`` / ``--cases``: the base config and its flags exactly as given."""


def select_cases(names: str | None, *, matrix: bool) -> list[Case]:
    """The cases ``--cases a,b`` names (in matrix order), all of them for ``--matrix``, else the base config."""
    if matrix:
        return list(MATRIX)
    if names is None:
        return [AS_CONFIGURED]
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = {case.key: case for case in MATRIX}
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(f"--cases {names!r}: unknown case(s) {unknown}; choose from {', '.join(known)}")
    return [case for case in MATRIX if case.key in wanted]
