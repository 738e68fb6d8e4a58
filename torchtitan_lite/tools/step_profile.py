"""Where a training step's time goes, by category: FP8 GEMMs, BF16 GEMMs of the blocks (per GEMM shape),
casts and amax, attention, head and loss, optimizer, communication, other.

A profile is a list of *records*, one per (kernel or op, the op that launched it, its ancestors, its input
shapes), with the total microseconds it took over the profiled steps. On a GPU a record is a device kernel
attributed to the CPU op that launched it; on a CPU it is an op's own (self) CPU time. The records are saved
as they are (``ProfileRecord`` JSON), so that a profile taken on a lent GPU can be classified again later;
``categorize`` turns them into per-step milliseconds per category and per BF16 GEMM shape.

The rules look at names, so they are heuristics and say so: a GEMM is an aten matmul op (``mm``, ``addmm``,
``bmm``, ``_grouped_mm``) or a kernel under one; an FP8 GEMM is ``_scaled_mm`` / ``_scaled_grouped_mm``;
attention is any op or kernel named for SDPA, flash or memory-efficient attention; the head is a GEMM with
a vocabulary-sized dimension, and the loss the cross-entropy ops; casts and amax are kernels whose (inductor
fused) name holds ``amax`` or ``clamp`` or ops under torchao's float8 functions; the optimizer is everything
under ``Optimizer.step``.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CATEGORIES = ("fp8_gemm", "gemm", "cast", "attention", "head", "optimizer", "communication", "other")
CATEGORY_TITLES = {
    "fp8_gemm": "FP8 GEMMs", "gemm": "BF16 GEMMs (blocks)", "cast": "casts and amax", "attention": "attention",
    "head": "head and loss", "optimizer": "optimizer", "communication": "communication", "other": "other",
}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm")
FP8_GEMM_OPS = ("aten::_scaled_mm", "aten::_scaled_grouped_mm")
ATTENTION_WORDS = ("scaled_dot_product", "flash", "efficient_attention", "cudnn_attention", "fmha")
LOSS_WORDS = ("cross_entropy", "log_softmax", "nll_loss")
CAST_WORDS = ("amax", "clamp", "float8", "fp8")
COMMUNICATION_WORDS = ("nccl", "c10d::", "gloo")
OPTIMIZER_MARK = "Optimizer.step"
UNATTRIBUTED = "(kernels without a recorded launching op)"
NOT_OPS = ("Command Buffer Full",)
"""CUPTI markers, not ops: kernels listed under them are listed under their real launching op too (on an H200,
the optimizer's multi_tensor_apply kernels appeared under both, 2 s per 0.5 s step)."""


@dataclass(frozen=True)
class ProfileRecord:
    name: str
    """The kernel's name (GPU) or the op's (CPU)."""
    op: str
    """The op that launched the kernel (the op itself on a CPU)."""
    chain: tuple[str, ...]
    """The launching op's ancestors, innermost first."""
    shapes: tuple[tuple[int, ...], ...]
    """Input shapes of the launching op (tensors only)."""
    us: float
    """Microseconds over all profiled steps."""
    count: int = 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProfileRecord:
        return cls(name=data["name"], op=data["op"], chain=tuple(data["chain"]),
                   shapes=tuple(tuple(s) for s in data["shapes"]), us=float(data["us"]), count=int(data["count"]))


def gemm_dims(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, int, int] | None:
    """(M, K, N) sorted, of a 2-D GEMM's input shapes, or None.

    The operands are the first two consecutive matrices [a, b] x [b, c]: addmm's bias comes before them and
    compiled code's ``mm(a, b, out=c)`` lists the output after them. Sorted: a Linear of K inputs and N outputs
    over M tokens runs three GEMMs (forward, input gradient, weight gradient), each over the dimensions
    {M, K, N} in another order; sorting names all three alike."""
    mats = [s for s in shapes if len(s) == 2]
    for (a, b), (b2, c) in zip(mats, mats[1:]):
        if b == b2:
            return tuple(sorted((a, b, c)))  # type: ignore[return-value]
    return None


def classify(record: ProfileRecord, *, vocab_size: int) -> str:
    """The category of one record (see the module docstring for the rules)."""
    names = (record.name, record.op, *record.chain)
    lowered = [n.lower() for n in names]
    if any(n.startswith(OPTIMIZER_MARK) for n in names) or "multi_tensor_apply" in lowered[0]:
        return "optimizer"
    if any(n in FP8_GEMM_OPS for n in names):
        return "fp8_gemm"
    if any(word in n for n in lowered for word in COMMUNICATION_WORDS):
        return "communication"
    if record.op in GEMM_OPS:
        dims = gemm_dims(record.shapes)
        return "head" if dims is not None and vocab_size in dims else "gemm"
    if any(word in n for n in lowered for word in ATTENTION_WORDS):
        return "attention"
    if any(word in n for n in lowered for word in LOSS_WORDS):
        return "head"
    if any(word in n for n in lowered for word in CAST_WORDS):
        return "cast"
    return "other"


@dataclass(frozen=True)
class StepProfile:
    """Per-step milliseconds per category, and the BF16 block GEMMs' per-step milliseconds per (M, K, N)."""

    ms: dict[str, float]
    gemm_ms: dict[tuple[int, int, int], float]
    steps: int

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    def to_json(self) -> dict[str, Any]:
        return {"ms": self.ms, "gemm_ms": [[list(k), v] for k, v in self.gemm_ms.items()], "steps": self.steps}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepProfile:
        return cls(ms=dict(data["ms"]), gemm_ms={(int(a), int(b), int(c)): v for (a, b, c), v in data["gemm_ms"]},
                   steps=int(data["steps"]))


def categorize(records: Iterable[ProfileRecord], *, vocab_size: int, steps: int) -> StepProfile:
    """Per-step milliseconds per category (every category present, zero where nothing fell in it)."""
    ms: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    gemm_ms: dict[tuple[int, int, int], float] = defaultdict(float)
    for record in records:
        if record.op in NOT_OPS:
            continue
        category = classify(record, vocab_size=vocab_size)
        per_step = record.us / 1e3 / steps
        ms[category] += per_step
        dims = gemm_dims(record.shapes) if category == "gemm" else None
        if dims is not None:
            gemm_ms[dims] += per_step
    return StepProfile(ms=ms, gemm_ms=dict(gemm_ms), steps=steps)


def category_table(profiles: dict[str, StepProfile]) -> str:
    """Markdown: milliseconds per step per category, one column per profiled config."""
    names = list(profiles)
    lines = ["| category | " + " | ".join(f"`{n}` ms/step" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for category in CATEGORIES:
        if all(p.ms.get(category, 0.0) == 0.0 for p in profiles.values()):
            continue
        lines.append(f"| {CATEGORY_TITLES[category]} | "
                     + " | ".join(f"{profiles[n].ms.get(category, 0.0):.2f}" for n in names) + " |")
    lines.append("| all profiled | " + " | ".join(f"{profiles[n].total_ms:.2f}" for n in names) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Taking the records from torch.profiler


def records_from_profiler(events: Any, *, device_type: str) -> list[ProfileRecord]:
    """Aggregated records from ``torch.profiler.profile(...).events()``: kernels on CUDA, self CPU time of
    leaf-most ops on CPU (an op's self time excludes its child ops, so nothing is counted twice)."""
    totals: dict[tuple, list[float]] = {}
    device_us = 0.0
    for event in events:
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            device_us += float(event.time_range.elapsed_us())  # counted through its launching op below
            continue
        if event.name in NOT_OPS:
            continue
        chain = _chain(event)
        shapes = tuple(tuple(s) for s in (getattr(event, "input_shapes", None) or []) if s)
        if device_type == "cuda":
            for kernel in getattr(event, "kernels", []) or []:
                _add(totals, (kernel.name, event.name, chain, shapes), float(kernel.duration))
        elif event.self_cpu_time_total > 0:
            _add(totals, (event.name, event.name, chain, shapes), float(event.self_cpu_time_total))
    records = [ProfileRecord(name, op, chain, shapes, us, int(count))
               for (name, op, chain, shapes), (us, count) in totals.items()]
    unattributed = device_us - sum(r.us for r in records) if device_type == "cuda" else 0.0
    if unattributed > 0.01 * device_us:  # kernels that no recorded op launched: kept, so the total is whole
        records.append(ProfileRecord(UNATTRIBUTED, "", (), (), unattributed, 1))
    return records


def _chain(event: Any, depth: int = 8) -> tuple[str, ...]:
    names: list[str] = []
    parent = getattr(event, "cpu_parent", None)
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return tuple(names)


def _add(totals: dict[tuple, list[float]], key: tuple, us: float) -> None:
    entry = totals.setdefault(key, [0.0, 0])
    entry[0] += us
    entry[1] += 1
