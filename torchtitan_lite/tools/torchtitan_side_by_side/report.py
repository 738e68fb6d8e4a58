"""The side by side's markdown: one table row per case (both trainers' runs, the ratio, its spread, the
host load) and the exact commands behind every row."""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from torchtitan_lite.tools.benchmark.run_info import cpu_description, git_commit
from torchtitan_lite.tools.repo import REPO_ROOT
from torchtitan_lite.tools.torchtitan_side_by_side.cases import Case
from torchtitan_lite.tools.torchtitan_side_by_side.layout import describe
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import Settings


@dataclass
class CaseResult:
    case: Case
    settings: Settings
    layout: dict[str, Any]
    ours_cmd: list[str]
    theirs_cmd: list[str]
    ours: list[float] = field(default_factory=list)
    """Steady tokens/s per device of each of our runs, in run order."""
    theirs: list[float] = field(default_factory=list)
    loads: list[float | None] = field(default_factory=list)
    """Host 1-minute load average when each repeat of the case started."""

    @property
    def ratio(self) -> float:
        """Our fastest run over torchtitan's fastest."""
        return max(self.ours) / max(self.theirs)

    @property
    def pair_ratios(self) -> list[float]:
        """Ours / torchtitan's for each repeat (the two runs made back to back)."""
        return [o / t for o, t in zip(self.ours, self.theirs, strict=True)]


def report_text(args: argparse.Namespace, versions: dict[str, str], results: list[CaseResult],
                skipped: dict[str, str]) -> str:
    """The markdown section: where and how it was measured, the table, and every run's commands."""
    import torch

    s = (results[0].settings if results else None)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    bf16 = "with" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "without"
    repeats = f", fastest of {args.repeats} interleaved runs per trainer" if args.repeats > 1 else ""
    scope = ", the matrix of cases" if len(results) + len(skipped) > 1 else ""
    lines = [
        f"### torchtitan {versions['torchtitan']} vs torchtitan_lite: `{args.config}` side by side{scope}",
        "",
        f"- device: {cpu_description(torch.get_num_threads())}, {bf16} oneDNN bfloat16 kernels; 2-process cases "
        f"run one OpenMP thread per process (torchrun's default on both sides); {date}; commit {git_commit()}",
        f"- torch {versions['torch']}, torchao {versions.get('torchao', '?')} in both environments",
        f"- command: `{shlex.join(['python', 'scripts/torchtitan_side_by_side.py', *sys.argv[1:]])}`",
    ]
    if s is not None:
        lines.append(
            f"- model: dim {s.dim}, {s.n_layers} layers, {s.n_heads} heads, {s.n_kv_heads} KV heads, FFN "
            f"{s.ffn_hidden_dim}, vocabulary {s.vocab_size}; seq {s.seq_len} x batch {s.local_batch_size} per "
            f"process; same layout on both sides in every case (checked: parameters, and every Linear's kind and "
            f"shape, separate wq / wk / wv); no AC / validation / checkpoints")
    lines += [
        f"- {args.steps} steps per run, logged every {args.log_freq}; tokens/s per process over steps "
        f"{args.warmup + 1}-{args.steps}{repeats}",
        "- ratio: our fastest run / torchtitan's fastest; spread: lowest-highest ours / torchtitan of one repeat "
        "(the two runs made back to back); load: host 1-minute load average when the case's runs started",
        "",
        "| case | our flags on top of the config | layout | torchtitan tokens/s (runs) | torchtitan_lite tokens/s "
        "(runs) | ratio | spread | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        pairs = r.pair_ratios
        loads = [x for x in r.loads if x is not None]
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"
        lines.append(f"| {r.case.key} | `{' '.join(r.case.overrides) or '(none)'}` | {describe(r.layout)} | "
                     f"{max(r.theirs):,.0f} ({_runs(r.theirs)}) | {max(r.ours):,.0f} ({_runs(r.ours)}) | "
                     f"**{r.ratio:.2f}x** | {min(pairs):.2f}-{max(pairs):.2f} | {load} |")
    for key, reason in skipped.items():
        lines.append(f"| {key} | | | not run: {reason} | | | | |")
    lines += ["", "Commands behind each row (paths relative to the repository; torchtitan runs with "
              "`PYTHONPATH=.cache/torchtitan_side_by_side`, where its generated config modules are):", ""]
    for r in results:
        lines.append(f"- {r.case.key}: torchtitan `{_display(r.theirs_cmd)}`; torchtitan_lite `{_display(r.ours_cmd)}`")
    lines.append("")
    return "\n".join(lines)


def _runs(values: list[float]) -> str:
    return ", ".join(f"{v:,.0f}" for v in values)


def _display(cmd: list[str]) -> str:
    """A command with paths inside the repository shown relative to it."""
    return shlex.join(arg.replace(str(REPO_ROOT) + os.sep, "") for arg in cmd)
