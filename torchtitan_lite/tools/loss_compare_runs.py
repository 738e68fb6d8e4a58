"""Training the runs scripts/loss_compare.py compares: one config into its own folder, with every step logged to
TensorBoard, progress lines while it trains, and the overrides the comparison controls refused."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from torchtitan_lite.tools.repo import REPO_ROOT
from torchtitan_lite.tools.run_progress import ProgressReporter, format_duration

OWNED_MARKER = ".loss_compare"
"""Written into each run folder this script creates: only such folders are ever cleared for a rerun."""
FINISHED = "finished.json"
"""Written into a run folder when its run exits 0: the command line and its wall time (a rerun may reuse it)."""
CONTROLLED_KEYS = ("--job.dump_folder", "--metrics.log_freq", "--metrics.enable_tensorboard",
                   "--metrics.save_tb_folder", "--metrics.rank_0_only")
"""Overrides the script sets itself so that every step lands in <dump-root>/<config>/tb."""


class CompareError(RuntimeError):
    """Bad input or a failed run; the message says what to fix."""


def check_passthrough(overrides: list[str], *, steps: int | None, seeds: int = 1) -> None:
    """Reject overrides the script controls itself, with the flag to use instead."""
    for token in overrides:
        key = token.partition("=")[0]
        if key in CONTROLLED_KEYS:
            raise CompareError(f"{key} is set by loss_compare (every step is logged to <dump-root>/<config>/tb); "
                               f"remove it, and use --dump-root to choose where the runs go")
        if key == "--training.steps" and steps is not None:
            raise CompareError("give the number of steps once: --steps N or the override --training.steps N")
        if key == "--training.seed" and seeds > 1:
            raise CompareError(f"--seeds {seeds} sets training.seed to 0..{seeds - 1} per run; remove the override "
                               f"--training.seed")
    if overrides and not overrides[0].startswith("--"):
        raise CompareError(f"overrides after '--' are --section.field VALUE pairs, got {overrides[0]!r} first")


def train_command(config: str, dump: Path, *, steps: int | None, overrides: list[str], nproc: int,
                  seed: int | None = None, fault: str | None = None) -> list[str]:
    """The command line that trains ``config`` into ``dump`` with every step logged to TensorBoard and, unless
    the overrides choose, no checkpoint (the comparison reads only the TensorBoard scalars); with the planted
    FP8 ``fault`` installed (fault_train.py, one process) where given."""
    args = ["--config", config, *overrides, "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "tb", "--metrics.rank_0_only", "true"]
    if not any(token.partition("=")[0] == "--checkpoint.enable" for token in overrides):
        args += ["--checkpoint.enable", "false"]
    if steps is not None:
        args += ["--training.steps", str(steps)]
    if seed is not None:
        args += ["--training.seed", str(seed)]
    if fault is not None:
        if nproc > 1:
            raise CompareError(f"a planted fault ({fault}) runs in one process; use --nproc 1")
        return [sys.executable, "-m", "torchtitan_lite.tools.fault_train", "--fault", fault, *args]
    if nproc > 1:
        return [str(REPO_ROOT / "run_train.sh"), *args]
    return [sys.executable, str(REPO_ROOT / "train.py"), *args]


def prepare_run_folder(dump: Path) -> None:
    """An empty folder for the run; a folder from an earlier loss_compare run is cleared, any other
    non-empty folder is refused (it could hold a checkpoint the run would resume from)."""
    if dump.exists() and any(dump.iterdir()):
        if not (dump / OWNED_MARKER).exists():
            raise CompareError(f"{dump} exists and was not written by loss_compare; choose another --dump-root "
                               f"or remove it")
        shutil.rmtree(dump)
    dump.mkdir(parents=True, exist_ok=True)
    (dump / OWNED_MARKER).write_text("run folder of scripts/loss_compare.py; cleared on its next run\n")


def run_config(config: str, dump: Path, *, steps: int | None, overrides: list[str], nproc: int,
               seed: int | None = None, label: str | None = None, progress_every: float = 30.0,
               cpu_threads: int | None = None, fault: str | None = None) -> float:
    """Train ``config`` into ``dump``; its console output goes to ``dump/train.log`` while progress lines
    (``label``: step k/N, ETA) are printed at most every ``progress_every`` seconds. ``cpu_threads`` sets the
    run's OMP_NUM_THREADS unless the environment already does. Returns the run's wall time in seconds."""
    label = label or config
    prepare_run_folder(dump)
    cmd = train_command(config, dump, steps=steps, overrides=overrides, nproc=nproc, seed=seed, fault=fault)
    # run_train.sh would otherwise look for (or build) its own environment; unbuffered, the progress is live.
    env = dict(os.environ, NPROC=str(nproc), PYTHONUNBUFFERED="1")
    env.setdefault("TTL_PYTHON", sys.executable)
    if cpu_threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
    log_path = dump / "train.log"
    print(f"[loss_compare] {label}: {' '.join(cmd)} (log: {log_path})", flush=True)
    progress = ProgressReporter(label, steps, interval_s=progress_every,
                                emit=lambda line: print(line, flush=True))
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            progress.feed(line)
        returncode = proc.wait()
    elapsed = time.perf_counter() - start
    if returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise CompareError(f"training {label} failed (exit {returncode}) after {elapsed:.0f}s; "
                           f"last lines of {log_path}:\n{tail}")
    print(f"[loss_compare] {label}: done in {format_duration(elapsed)}", flush=True)
    (dump / FINISHED).write_text(json.dumps({"command": cmd[1:], "wall_s": elapsed}))
    return elapsed


def finished_wall_s(config: str, dump: Path, *, steps: int | None, overrides: list[str], seed: int | None = None,
                    fault: str | None = None) -> float | None:
    """The wall time of a finished run in ``dump`` made by exactly the command ``run_config`` would run now
    (the interpreter aside), or None: a run with other arguments, an unfinished one or none at all is not
    reused."""
    try:
        record = json.loads((dump / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    cmd = train_command(config, dump, steps=steps, overrides=overrides, nproc=1, seed=seed, fault=fault)
    return float(record["wall_s"]) if record.get("command") == cmd[1:] else None


def tensorboard_folder(run: Path) -> Path:
    """``<run>/tb`` when it exists, else ``run`` itself (a TensorBoard folder given directly)."""
    tb = run / "tb"
    return tb if tb.is_dir() else run


def read_losses(run: Path, tag: str = "train/loss") -> dict[int, float]:
    """step -> value of ``tag`` from the TensorBoard event files of ``run``; the last write of a step wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tensorboard_folder(run)
    if not folder.is_dir() or not any(p.name.startswith("events.out.tfevents") for p in folder.iterdir()):
        raise CompareError(f"{run}: no TensorBoard event files in {folder}; give a run's dump folder (with tb/) "
                           f"or its TensorBoard folder")
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        raise CompareError(f"{folder} has no '{tag}' scalar (it has {sorted(acc.Tags()['scalars'])})")
    return {event.step: event.value for event in acc.Scalars(tag)}
