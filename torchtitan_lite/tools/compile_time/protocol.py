"""How a compile time is measured, the same in both trainers' processes (torch and the standard library only).

One process per measurement, its model's blocks already wrapped for compilation: the first forward +
backward (cross-entropy against random labels, no optimizer) pays tracing and code generation, the
following ones run the compiled code. The compile time is the first step minus the median of the others,
so the work every step does is not counted. Whether the inductor cache is cold or warm is decided by the
caller (the ``TORCHINDUCTOR_CACHE_DIR`` the process starts with).
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from typing import Any

RESULT_PREFIX = "compile-time result: "


def measure(model: Any, *, vocab_size: int, batch: int, seq_len: int, steps: int) -> dict[str, Any]:
    """Time the first forward + backward of ``model`` and ``steps`` more; what dynamo compiled meanwhile."""
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import calculate_time_spent, counters

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=generator)
    step_s = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        for p in model.parameters():
            p.grad = None
        step_s.append(time.perf_counter() - start)
    steady = statistics.median(step_s[1:])
    return {
        "first_step_s": step_s[0],
        "steady_step_s": steady,
        "compile_s": step_s[0] - steady,
        "dynamo_s": float(calculate_time_spent().get("total_wall_time", 0.0)),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
    }


def print_result(result: dict[str, Any]) -> None:
    """One line the runner finds in the process output."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def parse_result(output: str) -> dict[str, Any] | None:
    """The result line of a measuring process's output, or None."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None
