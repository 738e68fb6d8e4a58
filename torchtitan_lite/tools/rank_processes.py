"""The benchmarks' multi-rank runs: one process per rank on this machine, each measuring a list of items (cases,
schedules) with a process group, and the parent collecting every rank's result (or its traceback)."""
from __future__ import annotations

import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def _rank_main(rank: int, world: int, port: int, device: str, measure: Callable[..., Any], items: Sequence[Any],
               extra: tuple[Any, ...], queue: multiprocessing.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
        for item in items:
            queue.put((rank, True, measure(rank, world, item, *extra)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world: int, measure: Callable[..., Any], items: Sequence[Any], *extra: Any, label: str,
                 device: str = "cpu", timeout_s: float = 1800) -> list[Any]:
    """``measure(rank, world, item, *extra)`` for every item on each of ``world`` processes, one torch thread
    each; returns every result (in arrival order). ``label`` names the run in errors (e.g. 'cp=2')."""
    # CPU ranks are forked: they inherit the parent's imports of torch and the models. CUDA ranks are spawned,
    # since a CUDA runtime the imports may have started does not survive a fork.
    ctx = multiprocessing.get_context("spawn") if device == "cuda" else multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, device, measure, items, extra, queue),
                         daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    results: list[Any] = []
    expected = world * len(items)
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < expected:
            try:
                rank, ok, payload = queue.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except Exception:  # queue.Empty
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{label}: {len(results)} of {expected} results before the ranks stopped "
                                       f"(exit codes {[p.exitcode for p in procs]})") from None
                continue
            if not ok:
                raise RuntimeError(f"{label} rank {rank} failed:\n{payload}")
            results.append(payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return results
