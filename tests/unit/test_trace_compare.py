"""scripts/trace_compare.py (torchtitan_lite/tools/trace_compare.py): self time per op and per step from Chrome
traces."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan_lite.tools import trace_compare as tc


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _trace(path: Path, mm_us: float) -> Path:
    # Two steps of 1000 us; in each: a linear of 400 us calling mm (mm_us) and an optimizer op of 100 us,
    # plus an op on another thread that must not be nested under the first thread's ops.
    events = []
    for step, t0 in enumerate((0, 1000)):
        events += [_x(f"ProfilerStep#{step}", t0, 1000, cat="user_annotation"),
                   _x("aten::linear", t0 + 10, 400), _x("aten::mm", t0 + 20, mm_us),
                   _x("aten::_fused_adamw_", t0 + 500, 100), _x("aten::copy_", t0 + 15, 50, tid=2)]
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "M", "name": "meta"}]}))
    return path


def test_self_time_subtracts_children_and_divides_by_steps(tmp_path):
    times, step_ms, n = tc.self_times_per_step(tc.load_events(_trace(tmp_path / "a.json", 300)))
    assert n == 2 and step_ms == pytest.approx(1.0)
    # Exact: integer microseconds in, ms per step out.
    assert times == {"aten::linear": pytest.approx(0.1), "aten::mm": pytest.approx(0.3),
                     "aten::_fused_adamw_": pytest.approx(0.1), "aten::copy_": pytest.approx(0.05)}


def test_main_prints_largest_differences_first(tmp_path, capsys):
    a, b = _trace(tmp_path / "a.json", 300), _trace(tmp_path / "b.json", 200)
    folder = tmp_path / "traces"
    folder.mkdir()
    b.rename(folder / "b.json")
    assert tc.main([str(a), str(folder), "--labels", "x", "y", "--top", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert rows == ["| `aten::linear` | 0.10 | 0.20 | -0.10 |", "| `aten::mm` | 0.30 | 0.20 | +0.10 |"]


def test_gzipped_traces_in_a_folder_are_read_like_plain_ones(tmp_path):
    """torchtitan writes ``rank0_trace.json.gz``; the folder search must find and inflate it."""
    import gzip

    plain = _trace(tmp_path / "a.json", 300)
    folder = tmp_path / "iteration_20"
    folder.mkdir()
    (folder / "rank0_trace.json.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert tc.load_events(folder) == tc.load_events(plain)


def test_a_trace_without_steps_is_refused(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_x("aten::mm", 0, 5)]))
    assert tc.main([str(path), str(path)]) == 2
    assert "no ProfilerStep# window" in capsys.readouterr().err
