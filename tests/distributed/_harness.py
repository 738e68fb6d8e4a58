"""Run a function on N CPU processes joined by gloo, and collect what each rank returns.

Processes come from a forkserver that imports torch, torchao and the project once, so each test pays
milliseconds instead of seconds of imports per rank. `fn(rank, world_size, *args, **kwargs)` must be defined at
module level of an importable module. A failure on any rank raises in the caller with its traceback.
"""
from __future__ import annotations

import io
import multiprocessing
import os
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.distributed as dist

_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torchao.float8",
            "models.llama3.model", "models.llama3.parallelize", "_collectives", "_llama_steps"]
_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(_PRELOAD)


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300.0, **kwargs) -> list:
    """Results of `fn(rank, world_size, *args, **kwargs)` on ranks 0..world_size-1, in rank order."""
    port = _free_port()
    queue = _ctx.Queue()
    procs = [_ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, kwargs, queue), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank(s) {dead} died without a result (exit codes "
                                  f"{[procs[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"no result after {timeout_s:.0f}s")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _entry(fn, rank: int, world_size: int, port: int, args, kwargs, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        dist.barrier()
        # Serialised here: tensors pickled by the queue would be shared through file descriptors that
        # vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
