"""Measure one config in its own process (started by scripts/benchmark.py, one process per config so
that peak memory belongs to that config alone).

    python scripts/_bench_worker.py --json-out m.json --warmup 3 --steps 20 --config llama3_debug [--a.b v ...]
    torchrun --standalone --nproc_per_node 8 scripts/_bench_worker.py ...   (rank 0 writes the JSON)

The trainer is built from the registry config exactly as train.py builds it and trained with its own
``train()`` loop for warmup + steps steps, so every per-step cost of the real loop (data loading,
metrics, checkpoint checks, gc) is timed. ``train_step`` is wrapped to record when each step starts
and ends; the wrapper adds two clock reads per step. Validation is switched off (it is not training
throughput; an explicit ``--validation.enable true`` turns it back on and then counts; checkpointing
is off the same way).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.tools.benchmark.measurement import Measurement
from torchtitan_lite.tools.benchmark.run_info import cpu_description

GIB = 1024**3


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Measure the config selected by ``argv`` (``--config NAME`` from ``registry``) and write its JSON."""
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", required=True, help="where to write the measurement")
    parser.add_argument("--warmup", type=int, required=True, help="untimed steps first (>= 1)")
    parser.add_argument("--steps", type=int, required=True, help="timed steps (>= 1)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after the timed steps, this many more under torch.profiler (not timed)")
    parser.add_argument("--profile-out", type=Path, help="where to write the profile (step_profile records)")
    args, config_argv = parser.parse_known_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must both be >= 1 (the first step is never timed)")
    if args.profile_steps < 0 or (args.profile_steps > 0) != (args.profile_out is not None):
        parser.error("--profile-steps N (>= 1) and --profile-out PATH go together")
    _setup_logging()
    from torchtitan_lite.compile_cache import use_project_compile_caches

    use_project_compile_caches()  # as train.py: a config measured again on this machine autotunes nothing

    import torch.distributed as dist

    from torchtitan_lite.config import parse_cli
    from torchtitan_lite.mesh import process_groups as dist_utils

    with tempfile.TemporaryDirectory(prefix="bench_") as dump:
        # Later flags win: the user's overrides come after these defaults, the step count last.
        cli = parse_cli(["--validation.enable", "false", "--checkpoint.enable", "false", "--job.dump_folder", dump,
                         *config_argv, "--training.steps", str(args.warmup + args.steps + args.profile_steps)],
                        registry=registry)
        config: Any = cli.config  # set: the action is train
        trainer = config.build()
        spans, memory = _record_steps(trainer, timed=args.warmup + args.steps)
        if args.profile_steps:
            _profile_last_steps(trainer, first=args.warmup + args.steps, steps=args.profile_steps,
                                out=args.profile_out)
        try:
            trainer.train()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if dist_utils.is_rank0():
            measurement = _measurement(cli.config_name, trainer, spans, memory, args.warmup)
            Path(args.json_out).write_text(json.dumps(measurement.to_json(), indent=2))
    return 0


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[rank{os.environ.get('RANK', '0')}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("torchao").setLevel(logging.ERROR)


def _record_steps(trainer: Any, *, timed: int) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """Wrap ``trainer.train_step`` to record (start, end) of the first ``timed`` steps and the CUDA peak memory.

    The CUDA peak is read right after each step, before the metrics logger resets the counters.
    """
    import torch

    spans: list[tuple[float, float]] = []
    memory = {"allocated": 0.0, "reserved": 0.0}
    original = trainer.train_step
    cuda = trainer.device.type == "cuda"

    def timed_train_step(batches: Any) -> Any:
        start = time.perf_counter()
        result = original(batches)
        if cuda:  # the step reads nothing back by itself: wait for the device to finish it
            torch.cuda.synchronize(trainer.device)
        if len(spans) < timed:  # later (profiled) steps are not timed
            spans.append((start, time.perf_counter()))
        if cuda:
            memory["allocated"] = max(memory["allocated"], torch.cuda.max_memory_allocated(trainer.device) / GIB)
            memory["reserved"] = max(memory["reserved"], torch.cuda.max_memory_reserved(trainer.device) / GIB)
        return result

    trainer.train_step = timed_train_step
    return spans, memory


def _profile_last_steps(trainer: Any, *, first: int, steps: int, out: Path) -> None:
    """Run steps ``first`` .. ``first + steps - 1`` (0-based) under torch.profiler and write their records
    (tools/step_profile.py), with the vocabulary size and the shapes of the Linears a converter replaced."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_lite.tools.step_profile import records_from_profiler

    inner = trainer.train_step
    calls = {"n": 0}
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    profiler = profile(activities=activities, record_shapes=True)

    def profiled_train_step(batches: Any) -> Any:
        index = calls["n"]
        calls["n"] += 1
        if index == first:
            profiler.__enter__()
        result = inner(batches)
        if index == first + steps - 1:
            if cuda:
                torch.cuda.synchronize(trainer.device)
            profiler.__exit__(None, None, None)
            records = records_from_profiler(profiler.events(), device_type=trainer.device.type)
            out.write_text(json.dumps({"steps": steps, "device_type": trainer.device.type,
                                       "vocab_size": int(trainer.model_args.vocab_size), "converted": _converted_shapes(trainer),
                                       "records": [r.to_json() for r in records]}) + "\n")
        return result

    trainer.train_step = profiled_train_step


def _converted_shapes(trainer: Any) -> list[list[int]]:
    """(in, out) of every Linear-like module whose class a low-precision converter put in place of nn.Linear."""
    import torch.nn as nn

    shapes = set()
    for part in trainer.model_parts:
        for module in part.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and type(module) is not nn.Linear and weight is not None:
                shapes.add((int(module.in_features), int(module.out_features)))
    return sorted(list(s) for s in shapes)


def _measurement(config_name: str, trainer: Any, spans: list[tuple[float, float]], memory: dict[str, float],
                 warmup: int) -> Measurement:
    import torch

    cfg = trainer.config
    timed = range(warmup, len(spans))
    if trainer.device.type == "cuda":
        device_name = torch.cuda.get_device_name(trainer.device)
        peak_memory, reserved = memory["allocated"], memory["reserved"]
    else:
        device_name = cpu_description(torch.get_num_threads())
        # ru_maxrss is KiB on Linux, bytes on macOS.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        peak_memory, reserved = rss / GIB, None
    return Measurement(
        config=config_name,
        device_type=trainer.device.type,
        device_name=device_name,
        dp_degree=trainer.parallel_dims.dp_degree,
        tp_degree=cfg.parallelism.tp,
        tokens_per_step=trainer.n_microbatches * cfg.training.local_batch_size * cfg.training.seq_len,
        flops_per_token=float(trainer.metrics.num_flops_per_token),
        peak_flops=trainer.metrics.peak_flops,
        compile_enabled=cfg.compile.enable,
        first_step_s=spans[0][1] - spans[0][0],
        step_s=[spans[i][1] - spans[i - 1][1] for i in timed],
        train_step_s=[spans[i][1] - spans[i][0] for i in timed],
        peak_memory_gib=peak_memory,
        peak_reserved_gib=reserved,
    )

