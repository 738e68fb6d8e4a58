"""Layer gates of every FP8 recipe: per recipe, per layer kind, SQNR floors for the output, the input gradient and
the weight gradient, no saturated element, and a bounded share of elements flushed to zero.

    python scripts/fp8_sqnr.py --check                          # every recipe; exit status 1 on a failed gate
    python scripts/fp8_sqnr.py --check --recipes rowwise,mxfp8
    python scripts/fp8_sqnr.py --check --fault round_toward_zero  # a planted fault (fp8_faults.py): must fail

The probe is fixed and small so that it runs in seconds on a CPU: one Llama block (dim 128, feed-forward 384, so
that every Linear holds whole 128-wide blockwise tiles) in bfloat16 for the Linear recipes, and one layer of four
routed experts (dim 128, hidden 256; 40, 150, 0 and 66 tokens) for the expert recipes, two batches of 128 tokens
(256 for the experts). Each layer runs forward and backward in high precision and in its recipe (fp8_sqnr.py),
every recipe on the same inputs.

The upstream gradient is what makes gradient bugs visible: real activation gradients are small (the mean loss
over many tokens divides each one), so its elements are 2^-20 (~1e-6) standard normals; and tokens differ by
orders of magnitude (a confidently wrong prediction against a confidently right one), so one token's gradient is
2^16 times the others', 2^17 in the second batch (gradients grow from step to step before a spike). The SQNR of
the output and the input gradient weighs every token equally (``LinearSqnr.normalized_db``), the weight
gradient's every expert equally: a bug that loses the quiet tokens or experts cannot hide behind the loud one.

Saturation: the share of cast elements whose scaled magnitude lies beyond the format's largest finite value by
more than rounding (cast_health.saturation_threshold); dynamic scaling puts the largest at the maximum, so the
gate is 0. Underflow: the share of cast elements that are nonzero and cast to 0; the loud token makes every
recipe that scales a gradient along the tokens flush the quiet tokens in that cast, so each recipe's bound is
its measured share plus ``UNDERFLOW_MARGIN``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_lite.components.quantization.cast_health import saturation_threshold
from torchtitan_lite.tools.fp8_casts import observed_casts
from torchtitan_lite.tools.fp8_sqnr import QUANTITIES, LinearSqnr, TwinFactory, cast_parameters, measure_sqnr

LINEAR_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "blockwise_pow2")
EXPERT_RECIPES = ("experts_rowwise", "experts_mxfp8", "experts_blockwise", "experts_blockwise_pow2")
RECIPES = (*LINEAR_RECIPES, *EXPERT_RECIPES)
"""Every shipped FP8 recipe: the float8 converter's three, the mx converter's MXFP8, the float8_blockwise
converter's with float32 or power-of-2 scales, and the moe_experts converter's rowwise, MXFP8 and blockwise."""

MARGIN_DB = 1.0
"""Each floor is the measured SQNR less this. The probe is deterministic: its SQNR moves only with the order of
float32 sums (another CPU, BLAS or torch release), measured well under 0.1 dB; the smallest drop a planted fault
causes is several dB (docs/mixed_precision.md)."""
HIGH_PRECISION_DB = 100.0
"""The floor of a quantity a recipe computes in high precision (rowwise_with_gw_hp's weight gradient): exact on this
probe, and only float32 summation order can differ elsewhere (far above 100 dB)."""
UNDERFLOW_MARGIN = 0.01
"""Each underflow bound is the measured share plus one percentage point of the cast elements."""

GRAD_SCALE = 2.0 ** -20
LOUD_TOKEN, LOUD_FACTOR = 50, 2.0 ** 16
"""Row 50 of every upstream gradient is 2^16 (2^17 in the second batch) times the others."""
BATCHES, SEQ_LEN = 2, 128
EXPERT_COUNTS = (40, 150, 0, 66)
EXPERT_DIM, EXPERT_HIDDEN = 128, 256


def upstream_gradient(shape: torch.Size, generator: torch.Generator, batch: int) -> torch.Tensor:
    """2^-20 standard normals, the loud token's row 2^(16 + batch) times larger."""
    grad = torch.randn(shape, generator=generator) * GRAD_SCALE
    rows = grad.view(-1, shape[-1])
    rows[LOUD_TOKEN] *= LOUD_FACTOR * 2.0 ** batch
    return grad


# --------------------------------------------------------------------------------------------------
# Cast statistics


@dataclass
class CastCounts:
    elements: int = 0
    saturated: int = 0
    underflowed: int = 0

    def record(self, scaled: torch.Tensor, fp8: torch.Tensor) -> None:
        self.elements += scaled.numel()
        self.saturated += int((scaled.abs() >= saturation_threshold(fp8.dtype)).sum())
        self.underflowed += int(((scaled != 0) & (fp8.float() == 0)).sum())

    def share(self, what: str) -> float:
        return getattr(self, what) / self.elements if self.elements else 0.0


class CastObserver:
    """Counts every cast into the layer being compared (``layer``)."""

    def __init__(self) -> None:
        self.counts: dict[str, CastCounts] = {}
        self.current: CastCounts | None = None

    @contextlib.contextmanager
    def layer(self, name: str) -> Iterator[None]:
        self.current = self.counts.setdefault(name, CastCounts())
        try:
            yield
        finally:
            self.current = None

    def record(self, scaled: torch.Tensor, fp8: torch.Tensor) -> None:
        if self.current is not None:
            self.current.record(scaled, fp8)


# --------------------------------------------------------------------------------------------------
# The probe


@dataclass
class LayerResult:
    recipe: str
    layer: str
    kind: str
    """The layer's name without its block index ('attention.wq', 'experts.w2'): what the floors are keyed by."""
    db: dict[str, float]
    """Row-normalized SQNR (dB) per quantity (QUANTITIES)."""
    saturated: float
    underflowed: float


Install = Callable[[nn.Module], contextlib.AbstractContextManager[Any]]


def probe(recipe: str, install: Install | None = None) -> list[LayerResult]:
    """Every layer of ``recipe``'s probe; ``install(converted)`` (a planted fault) around the low-precision runs."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose from: {', '.join(RECIPES)}")
    observer = CastObserver()

    @contextlib.contextmanager
    def installed(converted: nn.Module) -> Iterator[None]:
        # The observer wraps the cast points after the fault has changed them: it sees the faulty casts.
        with install(converted) if install else contextlib.nullcontext(), observed_casts(observer.record):
            yield

    stats = (_probe_linears if recipe in LINEAR_RECIPES else _probe_experts)(recipe, installed, observer)
    results = []
    for s in stats:
        counts = observer.counts.get(s.fqn, CastCounts())
        kind = s.fqn.split(".", 2)[2] if s.fqn.startswith("layers.") else s.fqn
        results.append(LayerResult(recipe, s.fqn, kind, {q: s.normalized_db(q) for q in QUANTITIES},
                                   counts.share("saturated"), counts.share("underflowed")))
    return results


def linear_twin_factory(recipe: str) -> TwinFactory:
    """The Linear each Linear recipe trains with, as its converter builds it on this CPU."""
    if recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        from torchao.float8 import Float8LinearConfig

        from torchtitan_lite.compat import float8_recipe_needs_emulation
        from torchtitan_lite.tools.fp8_sqnr import float8_twin

        config = Float8LinearConfig.from_recipe_name(recipe)
        return float8_twin(dataclasses.replace(config, emulate=float8_recipe_needs_emulation(recipe, "cpu") is not None))
    if recipe == "mxfp8":
        from torchtitan_lite.components.quantization.mx_linear import mx_linear_from

        return lambda linear: mx_linear_from(linear, emulate=True, wgrad_with_hp=False)
    from torchtitan_lite.tools.fp8_sqnr import blockwise_twin

    return blockwise_twin(power_of_2=recipe == "blockwise_pow2")


def _probe_model() -> nn.Module:
    from torchtitan_lite.protocols.model_spec import get_model_spec

    spec = get_model_spec("llama3")  # registered by importing models (scripts/fp8_sqnr.py does)
    args = dataclasses.replace(spec.flavors["debug"], dim=128, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128,
                               multiple_of=128, max_seq_len=SEQ_LEN)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    cast_parameters(model, torch.bfloat16)
    return model.eval()


def _probe_linears(recipe: str, install: Install, observer: CastObserver) -> list[LinearSqnr]:
    model = _probe_model()
    rows = [_Row(fqn, m.in_features, m.out_features, recipe) for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and fqn != "output"]
    tokens = [torch.randint(0, 128, (1, SEQ_LEN), generator=torch.Generator().manual_seed(i)) for i in range(BATCHES)]
    return measure_sqnr(model, rows, linear_twin_factory(recipe), tokens, seed=0, upstream=upstream_gradient,
                        around_twins=install, around_layer=observer.layer)


@dataclass
class _Row:
    fqn: str
    in_features: int
    out_features: int
    recipe: str


class _ExpertGemms(nn.Module):
    """The grouped GEMM a recipe installs on an experts module, as a module a fault can be installed into."""

    def __init__(self, recipe: str) -> None:
        super().__init__()
        from torchtitan_lite.components.quantization.grouped_gemm import QuantizedGroupedMM

        name = recipe.removeprefix("experts_").removesuffix("_pow2")
        self.grouped_mm = QuantizedGroupedMM(name, True, [], power_of_2=recipe.endswith("_pow2"))


def _probe_experts(recipe: str, install: Install, observer: CastObserver) -> list[LinearSqnr]:
    g = torch.Generator().manual_seed(0)
    num = len(EXPERT_COUNTS)
    offsets = torch.cumsum(torch.tensor(EXPERT_COUNTS), 0).to(torch.int32)
    weights = {"w1": torch.randn(num, EXPERT_HIDDEN, EXPERT_DIM, generator=g) * 0.02,
               "w3": torch.randn(num, EXPERT_HIDDEN, EXPERT_DIM, generator=g) * 0.02,
               "w2": torch.randn(num, EXPERT_DIM, EXPERT_HIDDEN, generator=g) * 0.02}
    weights = {name: w.bfloat16() for name, w in weights.items()}
    stats = {name: LinearSqnr(f"experts.{name}", w.shape[2], w.shape[1], recipe) for name, w in weights.items()}
    gemms = _ExpertGemms(recipe)
    grad_gen = torch.Generator().manual_seed(0)
    with install(gemms):
        for batch in range(BATCHES):
            x = torch.randn(sum(EXPERT_COUNTS), EXPERT_DIM, generator=g)
            x = (x / x.square().mean(dim=-1, keepdim=True).sqrt()).bfloat16()  # RMS-normed, as the block feeds it
            with torch.no_grad():
                h = F.silu(_grouped(x, weights["w1"], offsets)) * _grouped(x, weights["w3"], offsets)
            for name in ("w1", "w3", "w2"):
                inputs = h if name == "w2" else x
                grad = upstream_gradient(torch.Size((inputs.shape[0], weights[name].shape[1])), grad_gen, batch)
                with observer.layer(stats[name].fqn):
                    _compare_grouped(inputs, weights[name], offsets, gemms, stats[name], grad.bfloat16())
    return list(stats.values())


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def _compare_grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gemms: _ExpertGemms,
                     stats: LinearSqnr, grad: torch.Tensor) -> None:
    results = []
    for gemm in (_grouped, lambda a, b, offs: gemms.grouped_mm(a, b.transpose(-2, -1), offs)):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = gemm(a, b, offsets)
        grad_x, grad_w = torch.autograd.grad(out, (a, b), grad)
        results.append((out, grad_x, grad_w))
    for quantity, reference, fp8 in zip(QUANTITIES, *results):
        stats.add(quantity, reference, fp8)


# --------------------------------------------------------------------------------------------------
# The gates


@dataclass(frozen=True)
class GateFailure:
    recipe: str
    layer: str
    gate: str
    """'output', 'grad_input', 'grad_weight' (SQNR floors), 'saturation' or 'underflow'."""
    measured: float
    limit: float

    def __str__(self) -> str:
        if self.gate in QUANTITIES:
            return (f"{self.recipe} {self.layer} {self.gate}: SQNR {self.measured:.1f} dB is below its floor "
                    f"{self.limit:.1f} dB")
        return (f"{self.recipe} {self.layer} {self.gate}: {self.measured:.2%} of the cast elements, more than the "
                f"bound {self.limit:.2%}")


def floor_db(recipe: str, kind: str, quantity: str) -> float:
    """The measured SQNR less MARGIN_DB; HIGH_PRECISION_DB where the recipe keeps the quantity in high precision."""
    measured = MEASURED_DB[recipe][kind][QUANTITIES.index(quantity)]
    return HIGH_PRECISION_DB if measured == math.inf else measured - MARGIN_DB


def underflow_bound(recipe: str) -> float:
    return MEASURED_UNDERFLOW[recipe] + UNDERFLOW_MARGIN


def check(results: list[LayerResult]) -> list[GateFailure]:
    """Every gate a layer fails. A NaN SQNR (an overflowed cast) fails its floor."""
    failures = []
    for r in results:
        for quantity in QUANTITIES:
            floor = floor_db(r.recipe, r.kind, quantity)
            if not r.db[quantity] >= floor:
                failures.append(GateFailure(r.recipe, r.layer, quantity, r.db[quantity], floor))
        if r.saturated > 0:
            failures.append(GateFailure(r.recipe, r.layer, "saturation", r.saturated, 0.0))
        if r.underflowed > underflow_bound(r.recipe):
            failures.append(GateFailure(r.recipe, r.layer, "underflow", r.underflowed, underflow_bound(r.recipe)))
    return failures


def format_results(results: list[LayerResult]) -> str:
    header = ("recipe", "layer", "output dB", "grad_input dB", "grad_weight dB", "saturated", "underflow")
    body = [(r.recipe, r.layer, *(f"{r.db[q]:.1f} ({floor_db(r.recipe, r.kind, q):.1f})" for q in QUANTITIES),
             f"{r.saturated:.2%}", f"{r.underflowed:.2%} ({underflow_bound(r.recipe):.2%})") for r in results]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [header, *body]]
    return "\n".join([*lines, "(floors and bounds in parentheses; saturation must be 0)"])


def run_check(recipes: list[str], fault: str | None = None) -> tuple[list[LayerResult], list[GateFailure]]:
    """Probe ``recipes`` (with planted ``fault`` on those it applies to) and check their gates."""
    install = None
    if fault is not None:
        from torchtitan_lite.tools.fp8_faults import FAULTS, plant

        if fault not in FAULTS:
            raise ValueError(f"unknown planted fault {fault!r}; choose one of: {', '.join(FAULTS)}")
        recipes = [r for r in recipes if r in FAULTS[fault].applies_to]

        def install(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
            return plant(fault, model)
    results = [r for recipe in recipes for r in probe(recipe, install)]
    return results, check(results)


# --------------------------------------------------------------------------------------------------
# Measured on the probe (docs/mixed_precision.md: command, CPU, torch and torchao versions). Per recipe and
# layer kind: row-normalized SQNR (dB) of (output, grad_input, grad_weight); per recipe: the largest underflow
# share of any of its layers.

MEASURED_DB: dict[str, dict[str, tuple[float, float, float]]] = {
    "tensorwise": {
        "attention.wq": (28.4, 24.5, 24.6),
        "attention.wk": (28.5, 24.6, 25.7),
        "attention.wv": (28.4, 24.6, 25.4),
        "attention.wo": (27.6, 24.4, 25.0),
        "feed_forward.w1": (28.5, 24.5, 24.9),
        "feed_forward.w2": (28.6, 24.6, 24.5),
        "feed_forward.w3": (28.5, 24.5, 24.6),
    },
    "rowwise": {
        "attention.wq": (28.4, 28.5, 28.6),
        "attention.wk": (28.4, 28.4, 28.6),
        "attention.wv": (28.5, 28.4, 28.7),
        "attention.wo": (27.7, 28.4, 28.6),
        "feed_forward.w1": (28.5, 28.5, 28.4),
        "feed_forward.w2": (28.4, 28.4, 28.9),
        "feed_forward.w3": (28.4, 28.4, 28.4),
    },
    "rowwise_with_gw_hp": {
        "attention.wq": (28.4, 28.5, math.inf),
        "attention.wk": (28.4, 28.4, math.inf),
        "attention.wv": (28.5, 28.4, math.inf),
        "attention.wo": (27.7, 28.4, math.inf),
        "feed_forward.w1": (28.5, 28.5, math.inf),
        "feed_forward.w2": (28.4, 28.4, math.inf),
        "feed_forward.w3": (28.4, 28.4, math.inf),
    },
    "mxfp8": {
        "attention.wq": (28.4, 28.5, 28.6),
        "attention.wk": (28.4, 28.4, 28.6),
        "attention.wv": (28.5, 28.4, 28.7),
        "attention.wo": (27.7, 28.4, 28.6),
        "feed_forward.w1": (28.5, 28.5, 28.4),
        "feed_forward.w2": (28.4, 28.4, 28.9),
        "feed_forward.w3": (28.4, 28.4, 28.4),
    },
    "blockwise": {
        "attention.wq": (28.7, 28.6, 31.9),
        "attention.wk": (28.5, 28.6, 31.9),
        "attention.wv": (28.7, 28.6, 31.9),
        "attention.wo": (27.8, 28.6, 31.1),
        "feed_forward.w1": (28.6, 28.5, 31.7),
        "feed_forward.w2": (29.0, 28.6, 32.7),
        "feed_forward.w3": (28.6, 28.6, 31.7),
    },
    "blockwise_pow2": {
        "attention.wq": (28.4, 28.5, 28.6),
        "attention.wk": (28.4, 28.4, 28.6),
        "attention.wv": (28.5, 28.4, 28.7),
        "attention.wo": (27.7, 28.4, 28.6),
        "feed_forward.w1": (28.5, 28.5, 28.4),
        "feed_forward.w2": (28.4, 28.4, 28.9),
        "feed_forward.w3": (28.4, 28.4, 28.4),
    },
    "experts_rowwise": {
        "experts.w1": (28.4, 28.4, 28.6),
        "experts.w3": (28.4, 28.4, 28.7),
        "experts.w2": (28.3, 28.4, 28.7),
    },
    "experts_mxfp8": {
        "experts.w1": (28.4, 28.4, 28.6),
        "experts.w3": (28.4, 28.4, 28.7),
        "experts.w2": (28.3, 28.4, 28.7),
    },
    "experts_blockwise": {
        "experts.w1": (28.6, 28.6, 29.9),
        "experts.w3": (28.6, 28.6, 29.9),
        "experts.w2": (28.9, 28.6, 30.3),
    },
    "experts_blockwise_pow2": {
        "experts.w1": (28.4, 28.4, 28.6),
        "experts.w3": (28.4, 28.4, 28.7),
        "experts.w2": (28.3, 28.4, 28.7),
    },
}
MEASURED_UNDERFLOW: dict[str, float] = {
    "tensorwise": 0.0001,
    "rowwise": 0.0403,
    "rowwise_with_gw_hp": 0.0000,
    "mxfp8": 0.0098,
    "blockwise": 0.0291,
    "blockwise_pow2": 0.0403,
    "experts_rowwise": 0.0138,
    "experts_mxfp8": 0.0026,
    "experts_blockwise": 0.0049,
    "experts_blockwise_pow2": 0.0070,
}
