"""Where and how benchmark numbers were produced: host, versions, commit, load."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import subprocess
from dataclasses import dataclass

from torchtitan_lite.components.device_peaks import cpu_model_name
from torchtitan_lite.tools.repo import REPO_ROOT


@dataclass(frozen=True)
class RunInfo:
    """Where and how the numbers were produced."""

    device: str
    peak_note: str
    """What MFU is measured against, in words."""
    torch_version: str
    torchao_version: str
    commit: str
    date: str
    command: str
    warmup: int
    steps: int
    repeats: int = 1
    load: str = ""
    """Host load average before and after the run (other work on the machine slows it down)."""


def run_info(*, device: str, peak_note: str, command: str, warmup: int, steps: int, repeats: int = 1,
             load: str = "") -> RunInfo:
    import torch

    return RunInfo(
        device=device, peak_note=peak_note, torch_version=torch.__version__,
        torchao_version=package_version("torchao"), commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=command, warmup=warmup, steps=steps, repeats=repeats, load=load,
    )


def load_average() -> float | None:
    """1-minute load average of the host, None where the OS does not report it."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def package_version(name: str) -> str:
    """Installed version of a distribution, or 'not installed'."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """Short HEAD hash, marked when tracked files differ from it (the numbers may include those edits)."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = git("diff", "--quiet", "HEAD", "--").returncode != 0
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def cpu_description(threads: int) -> str:
    """CPU model, core count and torch thread count, as the benchmark tables state the device."""
    return f"{cpu_model_name()} ({os.cpu_count()} cores, {threads} torch thread{'s' if threads != 1 else ''})"
