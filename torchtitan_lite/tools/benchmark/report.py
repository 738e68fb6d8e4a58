"""Throughput arithmetic and the markdown / PNG report of scripts/benchmark.py.

A worker process measures one config and hands back a ``Measurement`` (raw wall-clock times and the
sizes needed to turn them into rates); everything derived from it (tokens/s, TFLOP/s, MFU, compile
time, speedup, trainer-vs-bare-loop ratio) is computed here, so the arithmetic is testable on fake
measurements without training anything.
"""
from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.tools.benchmark.measurement import BareMeasurement, Measurement
from torchtitan_lite.tools.benchmark.run_info import RunInfo


@dataclass(frozen=True)
class Row:
    """One line of the report table."""

    config: str
    tokens_per_s_device: float
    tokens_per_s_total: float
    tflops_device: float
    mfu_percent: float | None
    step_ms: float
    step_cv_percent: float
    """Coefficient of variation of the timed step times: how noisy the measurement was."""
    loop_overhead_percent: float
    """Share of the step wall time spent outside train_step (data loading, metrics, gc, ...)."""
    compile_s: float | None
    memory: str
    speedup: float
    """Total tokens/s over the baseline's."""
    bare_tokens_per_s: float | None = None
    trainer_over_bare: float | None = None
    """Trainer step / bare step tokens/s, both measured alternately in one process."""
    bare_note: str = ""
    """Why no bare-loop number exists for this config (empty when there is one)."""


def summarize(m: Measurement, *, baseline_tokens_per_s: float, bare: BareMeasurement | None = None,
              bare_note: str = "") -> Row:
    """Rates of one measurement; ``baseline_tokens_per_s`` is the baseline's total tokens/s."""
    if not m.step_s:
        raise ValueError(f"{m.config}: no timed steps were measured; use --steps >= 1")
    mean_step = sum(m.step_s) / len(m.step_s)
    tokens_per_s_rank = m.tokens_per_step / mean_step
    per_device = tokens_per_s_rank / m.tp_degree
    total = tokens_per_s_rank * m.dp_degree
    flops_device = per_device * m.flops_per_token
    mfu = 100.0 * flops_device / m.peak_flops if m.peak_flops else None
    cv = 100.0 * statistics.pstdev(m.step_s) / mean_step
    outside = 100.0 * (1.0 - sum(m.train_step_s) / sum(m.step_s))
    # The first step pays for compilation; what it took beyond a steady step is the compile cost.
    compile_s = m.first_step_s - statistics.median(m.train_step_s) if m.compile_enabled else None
    if m.peak_reserved_gib is not None:
        memory = f"{m.peak_memory_gib:.2f} / {m.peak_reserved_gib:.2f}"
    else:
        memory = f"{m.peak_memory_gib:.2f}"
    return Row(
        config=m.config,
        tokens_per_s_device=per_device,
        tokens_per_s_total=total,
        tflops_device=flops_device / 1e12,
        mfu_percent=mfu,
        step_ms=1e3 * mean_step,
        step_cv_percent=cv,
        loop_overhead_percent=outside,
        compile_s=compile_s,
        memory=memory,
        speedup=total / baseline_tokens_per_s,
        bare_tokens_per_s=bare.tokens_per_s if bare else None,
        trainer_over_bare=(bare.trainer_tokens_per_s / bare.tokens_per_s
                           if bare and bare.trainer_tokens_per_s is not None else None),
        bare_note=bare_note,
    )


def build_rows(measurements: list[Measurement], baseline: str, bare: dict[str, BareMeasurement] | None = None,
               bare_notes: dict[str, str] | None = None) -> list[Row]:
    """Rows in measurement order, speedups against the config named ``baseline``."""
    by_name = {m.config: m for m in measurements}
    if baseline not in by_name:
        raise ValueError(f"baseline {baseline!r} was not measured; measured: {', '.join(by_name)}")
    base = by_name[baseline]
    base_total = base.tokens_per_step * base.dp_degree / (sum(base.step_s) / len(base.step_s))
    bare, bare_notes = bare or {}, bare_notes or {}
    return [summarize(m, baseline_tokens_per_s=base_total, bare=bare.get(m.config),
                      bare_note=bare_notes.get(m.config, "")) for m in measurements]


# --------------------------------------------------------------------------------------------------
# Rendering


def markdown_table(rows: list[Row], baseline: str) -> str:
    with_bare = any(r.bare_tokens_per_s is not None or r.bare_note for r in rows)
    header = ["config", "tokens/s/device", "tokens/s total", "TFLOP/s/device", "MFU", "step ms (cv)",
              "outside train_step", "cold compile s", "peak memory GiB", f"speedup vs {baseline}"]
    if with_bare:
        header += ["bare loop tokens/s", "trainer step / bare step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [
            f"`{r.config}`",
            f"{r.tokens_per_s_device:,.0f}",
            f"{r.tokens_per_s_total:,.0f}",
            f"{r.tflops_device:.4g}",
            "-" if r.mfu_percent is None else f"{r.mfu_percent:.1f}%",
            f"{r.step_ms:,.1f} ({r.step_cv_percent:.0f}%)",
            f"{r.loop_overhead_percent:.1f}%",
            "-" if r.compile_s is None else f"{r.compile_s:.1f}",
            r.memory,
            f"{r.speedup:.2f}x",
        ]
        if with_bare:
            if r.bare_tokens_per_s is None:
                cells += [r.bare_note or "-", "-"]
            else:
                ratio = "-" if r.trainer_over_bare is None else f"{r.trainer_over_bare:.3f}"
                cells += [f"{r.bare_tokens_per_s:,.0f}", ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_section(rows: list[Row], info: RunInfo, *, baseline: str, title: str, memory_note: str) -> str:
    repeats = f", best of {info.repeats} interleaved runs per config" if info.repeats > 1 else ""
    return "\n".join([
        f"### {title}",
        "",
        f"- device: {info.device}" + (f"; host load average {info.load}" if info.load else ""),
        f"- torch {info.torch_version}, torchao {info.torchao_version}, commit {info.commit}, {info.date}",
        f"- command: `{info.command}`",
        f"- {info.warmup} warm-up step(s) excluded, {info.steps} timed step(s){repeats}; MFU against {info.peak_note}",
        f"- peak memory: {memory_note}; 'outside train_step' is the share of step time spent in the loop around "
        f"it (data loading, metrics, gc)",
        *(["- bare loop: scripts/bare_loop.py --against-trainer, the same steps alternated one by one in one process "
           "with the trainer's data fetch + train_step (its ratio); the loop around train_step is the "
           "'outside train_step' share"] if any(r.bare_tokens_per_s is not None for r in rows) else []),
        "",
        markdown_table(rows, baseline),
        "",
    ])


def write_markdown(path: Path, section: str, *, append: bool) -> None:
    path = Path(path)
    if append and path.exists():
        existing = path.read_text()
        separator = "" if existing.endswith("\n\n") else ("\n" if existing.endswith("\n") else "\n\n")
        path.write_text(existing + separator + section)
    else:
        path.write_text(section)


def save_bar_chart(rows: list[Row], path: Path, *, title: str, baseline: str) -> None:
    """Bar chart of tokens/s per device, each bar labelled with its speedup over the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(rows) + 1.5), 4.0))
    names = [r.config for r in rows]
    values = [r.tokens_per_s_device for r in rows]
    bars = ax.bar(names, values, color=["tab:gray" if r.config == baseline else "tab:blue" for r in rows])
    for bar, row in zip(bars, rows):
        ax.annotate(f"{row.tokens_per_s_device:,.0f}\n{row.speedup:.2f}x", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s per device")
    ax.set_title("\n".join(textwrap.wrap(title, 60)), fontsize=9)
    ax.set_ylim(0, max(values) * 1.25)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
