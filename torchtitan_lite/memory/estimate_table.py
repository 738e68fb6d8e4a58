"""The text of a memory estimate: how each term is described (sharding, optimizer states, FSDP's gathered
weights) and the table of terms and step moments that --estimate-memory prints."""
from __future__ import annotations

from torchtitan_lite.memory.layout import ModelLayout
from torchtitan_lite.memory.terms import GIB, MemoryEstimate
from torchtitan_lite.memory.timeline import Moment
from torchtitan_lite.resolved_run import ResolvedRun


def gathered_text(run: ResolvedRun, fsdp: bool, layout: ModelLayout) -> str:
    if not fsdp:
        return "no FSDP"
    policy = run.fsdp_reshard_after_forward
    float8 = ", float8 all-gather" if layout.float8_all_gather else ""
    return f"reshard_after_forward={policy}{float8}"


def sharding_text(layout: ModelLayout) -> str:
    dims = layout.dims
    parts = [f"TP {dims.tp}"] if dims.tp_enabled else []
    # Under context parallelism FSDP shards over dp_shard x cp (its ranks hold the same weights).
    cp = f" (dp_shard {dims.dp_shard} x cp {dims.cp})" if dims.cp_enabled else ""
    if dims.fsdp_enabled and dims.dp_shard * dims.cp > 1:
        parts.append(f"FSDP {dims.dp_shard * dims.cp}{cp}")
    text = "sharded " + " x ".join(parts) if parts else "not sharded"
    if dims.ep_enabled:
        expert_degree = dims.expert_fsdp_degree  # dp_shard x cp / ep under CP
        expert_fsdp = f" x FSDP {expert_degree}" if dims.fsdp_enabled and expert_degree > 1 else ""
        text += f"; routed experts EP {dims.ep}{expert_fsdp}"
    return text


def optimizer_text(low_bit: str | None) -> str:
    if low_bit is None:
        return "2 x fp32 moments + step"
    return f"torchao {low_bit}: 2 x (codes + fp32 block scales) + step; fp32 below 4096 elements"


def mib(nbytes: int) -> str:
    return f"{nbytes / 1024**2:.1f} MiB"


def table(est: MemoryEstimate, moments: list[Moment]) -> str:
    peak = est.peak_moment
    rows = [(t.name, t.nbytes, t.how) for t in est.terms]
    moment_rows = [(f"at {m.name}", m.nbytes, "<- peak" if m is peak else "") for m in moments]
    breakdown = ", ".join(f"{k} {v / GIB:.2f}" for k, v in peak.parts.items() if v)
    summary = [("peak allocated", est.peak_allocated, f"at {peak.name}: {breakdown} GiB")]
    if est.device_type == "cuda":
        summary.append(("total per device", est.total, "peak allocated + CUDA context; compare with nvidia-smi"))
    width = max(len(r[0]) for r in rows + moment_rows + summary)

    def line(name: str, nbytes: int, how: str) -> str:
        return f"{name:<{width}}  {nbytes / GIB:>9.3f}  {nbytes:>17,}  {how}".rstrip()

    return "\n".join([
        f"memory estimate per rank{'' if est.pp_rank is None else f' (pp rank {est.pp_rank})'}: {est.layout}, "
        f"{est.device_type}"
        + ("" if est.device_type == "cuda" else " (this machine; CUDA runs differ: estimate on the GPU host)"),
        f"model: {est.model}",
        f"{'component':<{width}}  {'GiB':>9}  {'bytes':>17}  how",
        *(line(*r) for r in rows),
        f"{'step moments':<{width}}  device bytes allocated where the peak can occur",
        *(line(*r) for r in moment_rows),
        *(line(*r) for r in summary),
        *([est.all_gather] if est.all_gather else []),
    ])
