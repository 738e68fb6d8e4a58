"""Entry point: parse the command line, build the Trainer, train.

    python train.py --config llama3_debug --training.steps 20
    torchrun --nproc_per_node 8 train.py --config llama3_8b_fp8
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import warnings

import torchtitan_lite.tools.project_python  # noqa: F401  (no torch in this Python: re-runs with the project's)

TORCH_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""torch's own log lines without the "[rankN]:" its formatter adds once a process group exists."""


def _setup_logging() -> None:
    # run_train.sh's torchrun (--tee --role rank) already starts every line with "[rankN]:".
    launcher_prefixes = os.environ.get("TORCHTITAN_LITE_LAUNCHER_PREFIXES_RANK") == "1"
    rank = "" if launcher_prefixes else f"[rank{os.environ.get('RANK', '0')}] "
    if launcher_prefixes:
        # torch reads its log format when it is imported, which is after this; a user's own format stays.
        os.environ.setdefault("TORCH_LOGS_FORMAT", TORCH_LOG_FORMAT)
    logging.basicConfig(
        level=logging.INFO,
        format=f"{rank}%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )
    # Per-split progress bars from datasets drown the training log.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()


def _restore_signals_ignored_by_launcher() -> None:
    """scripts/torchrun_graceful.sh makes torchrun ignore SIGTERM / SIGUSR1 and the workers inherit
    that; give them the default back so the trainer's preemption handler (or a plain exit) owns them."""
    if os.environ.pop("TORCHTITAN_LITE_RESTORE_SIGNALS", None) == "1":
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)


def _leave_together() -> None:
    """Ranks of a finished run meet once more before the process group is torn down: a gloo rank
    that closes its connections while a peer still uses them aborts that peer at exit."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def main(argv: list[str]) -> int:
    _restore_signals_ignored_by_launcher()
    from torchtitan_lite.orphan_guard import stop_when_launcher_dies

    stop_when_launcher_dies()
    _setup_logging()
    from torchtitan_lite.compile_cache import use_project_compile_caches

    use_project_compile_caches()  # before anything compiles: kernels and autotuning survive the process
    # The one place where the model families and the registered configs meet the core: importing
    # `models` registers each family's spec; the registry is handed to the parser and the actions.
    import models  # noqa: F401
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.config import ConfigError, parse_cli

    try:
        cli = parse_cli(argv, registry=DEFAULT_REGISTRY)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cli.action != "train":
        from torchtitan_lite.actions import run_action

        return run_action(cli, registry=DEFAULT_REGISTRY)

    from torchtitan_lite.components.checkpoint import CheckpointError
    from torchtitan_lite.run_lock import RunLock
    from torchtitan_lite.spike_guard import SpikeError
    from torchtitan_lite.trainer import NonFiniteLossError

    lock = None
    try:
        # One process per launch holds the dump folder's lock (global rank 0 is LOCAL_RANK 0 of node 0),
        # taken before any process-group work so the ranks of one run never refuse each other.
        if os.environ.get("RANK", "0") == "0":
            lock = RunLock.acquire(cli.config.job.dump_folder)
        trainer = cli.config.build()
        trainer.train()
        _leave_together()
    except (ValueError, NonFiniteLossError, SpikeError, CheckpointError) as err:
        logging.getLogger("torchtitan_lite").error("%s", err)
        return 1
    except RuntimeError as err:
        from torchtitan_lite.peer_failure import peer_lost

        # A peer that died leaves this rank a backend traceback that explains nothing: one line instead.
        message = peer_lost(err)
        if message is None:
            raise
        logging.getLogger("torchtitan_lite").error("%s", message)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
