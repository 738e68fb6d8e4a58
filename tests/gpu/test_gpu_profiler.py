"""CUDA allocator snapshots: the profiler writes one at each profile_freq step (on CPU it is a logged no-op,
tests/unit/test_profiler.py)."""
from __future__ import annotations

import pickle

import pytest
import torch

from torchtitan_lite.components.profiler import Profiler

pytestmark = pytest.mark.gpu


def test_memory_snapshot_on_cuda(tmp_path):
    profiler = Profiler.Config(enable_memory_snapshot=True, profile_freq=2, warmup=0).build(
        dump_folder=str(tmp_path), rank=0
    )
    with profiler:
        for _ in range(2):
            torch.randn(256, 256, device="cuda").sum()
            profiler.step()
    snapshot = tmp_path / "profiles/iteration_2/rank0_memory_snapshot.pickle"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == \
        ["profiles/iteration_2/rank0_memory_snapshot.pickle"]
    # A real allocator snapshot: the segments torch.cuda.memory._snapshot() reports, not an empty file.
    with snapshot.open("rb") as f:
        assert pickle.load(f)["segments"]
