import json
import logging

import pytest
import torch

from torchtitan_lite.components.profiler import Profiler


def _work() -> None:
    a = torch.randn(16, 16)
    torch.mm(a, a)


def _run(profiler: Profiler, steps: int) -> None:
    with profiler:
        for _ in range(steps):
            _work()
            profiler.step()


def _traces(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_traces_land_on_multiples_of_profile_freq(tmp_path):
    config = Profiler.Config(enable_profiling=True, profile_freq=3, warmup=1, active=1)
    _run(config.build(dump_folder=str(tmp_path), rank=0), steps=7)
    assert _traces(tmp_path) == ["profiles/iteration_3/rank0_trace.json", "profiles/iteration_6/rank0_trace.json"]
    trace = json.loads((tmp_path / "profiles/iteration_3/rank0_trace.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])


def test_resumed_run_keeps_the_same_iterations(tmp_path):
    config = Profiler.Config(enable_profiling=True, profile_freq=3, warmup=1, active=1, save_traces_folder="p")
    _run(config.build(dump_folder=str(tmp_path), start_step=4, rank=1), steps=3)  # training steps 5, 6, 7
    assert _traces(tmp_path) == ["p/iteration_6/rank1_trace.json"]


def test_disabled_profiler_writes_nothing(tmp_path):
    profiler = Profiler.Config(profile_freq=1, warmup=0).build(dump_folder=str(tmp_path), rank=0)
    _run(profiler, steps=3)
    assert profiler.step_num == 3 and _traces(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU no-op (tests/gpu/test_gpu_profiler.py on CUDA)")
def test_memory_snapshot_is_a_logged_no_op_on_cpu(tmp_path, caplog):
    profiler = Profiler.Config(enable_memory_snapshot=True, profile_freq=1, warmup=0).build(
        dump_folder=str(tmp_path), rank=0
    )
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        _run(profiler, steps=2)
    assert "memory snapshots are a CUDA allocator feature; nothing is recorded on CPU" in caplog.text
    assert _traces(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"profile_freq": 0}, r"profiling.profile_freq must be >= 1, got 0"),
        ({"active": 0}, r"profiling.active >= 1, got warmup=3, active=0"),
        ({"profile_freq": 3, "warmup": 3, "active": 1}, r"3 \+ 1 must fit in profiling.profile_freq=3"),
        ({"save_traces_folder": ""}, r"profiling.save_traces_folder must be a folder name"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Profiler.Config(**kwargs)
