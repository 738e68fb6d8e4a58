"""Helpers to run the real entry points (run_train.sh / train.py) in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The suite already runs inside the project's interpreter; run_train.sh must not rebuild it.
    env["TTL_PYTHON"] = sys.executable
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(extra)
    return env


def run_cli(args: list[str], *, timeout: int = 600, launcher: str = "run_train.sh", **env: str):
    """Run ./run_train.sh (torchrun), train.py (in-process) or another Python script standing in for
    train.py (a path) with ``args``; returns CompletedProcess. It runs in the test's working directory (its
    own tmp_path, see tests/conftest.py), so the default ./outputs is the test's, not the checkout's."""
    if launcher == "run_train.sh":
        cmd = [str(ROOT / "run_train.sh"), *args]
    else:
        cmd = [sys.executable, str(ROOT / launcher if launcher == "train.py" else launcher), *args]
    return subprocess.run(cmd, cwd=os.getcwd(), env=_env(**env), capture_output=True, text=True, timeout=timeout)


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the TensorBoard event files of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


TINY = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.log_freq", "1"]
"""A llama3_debug run whose step takes tens of milliseconds on a CPU."""


def train_cmd(args: list[str], *, nproc: int | None = None, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """``python train.py args`` (nproc None) or torchrun with ``nproc`` workers on one node, started the
    way run_train.sh starts it (scripts/torchrun_graceful.sh)."""
    if nproc is None:
        return [sys.executable, str(ROOT / "train.py"), *args]
    return ["bash", str(ROOT / "scripts" / "torchrun_graceful.sh"), sys.executable, "--standalone",
            f"--nproc_per_node={nproc}", *torchrun_args, str(ROOT / "train.py"), *args]


class Launch:
    """A training launch running in the background in its own session (process group).

    Its merged stdout/stderr is collected line by line so a test can wait for a log line, then
    signal the launcher, the whole group or one worker, as a scheduler or a crash would.
    """

    running: list[Launch] = []
    """Launches not yet finished; the suite kills what a failed test leaves behind (see conftest.py)."""

    def __init__(self, cmd: list[str], **env: str) -> None:
        import threading

        self.proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=_env(**{"OMP_NUM_THREADS": "1", **env}),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        Launch.running.append(self)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, *, timeout: float = 120, poll: float = 0.01):
        """Block until a line matches ``pattern`` (regex); returns the match. Fails on exit or timeout."""
        import re
        import time

        regex, seen, deadline = re.compile(pattern), 0, time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines[seen:]
            for line in lines:
                match = regex.search(line)
                if match:
                    return match
            seen += len(lines)
            if self.proc.poll() is not None and seen == len(self.lines):
                self._reader.join(5)
                if len(self.lines) == seen:
                    raise AssertionError(f"exited ({self.proc.returncode}) before /{pattern}/:\n{self.output[-4000:]}")
            time.sleep(poll)
        self.kill()
        raise AssertionError(f"no /{pattern}/ within {timeout}s:\n{self.output[-4000:]}")

    def descendants(self) -> list[int]:
        """Every process below the launcher (torchrun starts its workers in sessions of their own)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                tasks = Path(f"/proc/{pid}/task").iterdir()
                children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
            except FileNotFoundError:  # exited meanwhile
                continue
            found += children
            todo += children
        return found

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the training workers: the launch's descendants carrying RANK in their environment."""
        pids = {}
        for pid in self.descendants():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            ranks = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if ranks:
                pids[int(ranks[0])] = pid
        return pids

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def signal_launcher(self, sig: int) -> None:
        """Only the launched process (e.g. run_train.sh), as a scheduler signalling the batch shell does."""
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 300) -> int:
        """Wait for the launch to exit (killing its whole group past ``timeout``); returns its exit code."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired as timed_out:
            self.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.output[-4000:]}") from timed_out
        self._reader.join(10)
        Launch.running.remove(self)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the launcher's group and every process below it (workers live in their own sessions)."""
        import signal

        below = self.descendants()
        for kill, pid in [(os.killpg, self.proc.pid), *((os.kill, p) for p in below)]:
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        if self in Launch.running:
            Launch.running.remove(self)


def read_checkpoint(path: Path) -> dict[str, object]:
    """Flat ``{dotted.key: value}`` of a DCP checkpoint, sharded tensors gathered, per-rank states decoded."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from torchtitan_lite.components.checkpoint.stateful import decode

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=True)

    def flatten(prefix: str, value) -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(f"{prefix}{key}.", item).items()}
        return {prefix[:-1]: value}

    for name in ("dataloader", "train_state"):
        for key, encoded in state.get(name, {}).items():
            state[name][key] = decode(encoded)
    return flatten("", state)


def differences(a: dict[str, object], b: dict[str, object]) -> list[str]:
    """Keys whose values are not bitwise equal, and keys present in one side only."""
    import torch

    diffs = [f"{k}: only in {'first' if k in a else 'second'}" for k in sorted(set(a) ^ set(b))]
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype \
                and torch.equal(x, y)
        else:
            same = x == y
        if not same:
            diffs.append(key)
    return diffs
