"""scripts/compile_time_bench.py without running compilers: the measuring protocol on an eager model, the
model both trainers build, the commands and the table."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import models  # noqa: F401  (registers the model families)
from models.llama3.model import Llama3ModelArgs, Transformer
from torchtitan_lite.tools.compile_time import protocol, runner


def test_protocol_times_first_and_steady_steps_and_result_line_round_trips(capsys):
    torch.manual_seed(0)
    model = Transformer(Llama3ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, multiple_of=16,
                                        max_seq_len=16))
    result = protocol.measure(model, vocab_size=64, batch=2, seq_len=8, steps=2)
    assert result["compile_s"] == result["first_step_s"] - result["steady_step_s"]
    assert result["params"] == sum(p.numel() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())  # no gradient is left behind between steps
    protocol.print_result(result)
    assert protocol.parse_result("noise\n" + capsys.readouterr().out + "more noise\n") == result
    assert protocol.parse_result("no result") is None


def test_8b_width_settings_and_both_commands(tmp_path):
    s = runner.model_settings(runner.SIZES["8b"], 8)
    assert (s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.ffn_hidden_dim, s.vocab_size) == (4096, 8, 32, 8, 14336, 2048)
    assert s.param_dtype == "bfloat16"
    args = argparse.Namespace(steps=3, run_dir=tmp_path)
    ours = runner.our_command(args, "8b", 8)
    assert ours[1].endswith("scripts/_compile_time_worker.py") and ours[2:] == [
        "--flavor", "8B", "--layers", "8", "--vocab-size", "2048", "--dtype", "bfloat16", "--batch", "1",
        "--seq-len", "128", "--steps", "3"]
    theirs = runner.torchtitan_command(Path("/venv/bin/python"), args, "8b", 8)
    assert theirs[:2] == ["env", f"PYTHONPATH={tmp_path}"] and "compile-time" in theirs
    source = (tmp_path / "ttl_compile_8b_8.py").read_text()
    assert "DIM, N_LAYERS, N_HEADS, N_KV_HEADS = 4096, 8, 32, 8" in source


def test_report_scales_each_depth_by_the_shallowest_and_compares_trainers(monkeypatch):
    def measured(cold: float, warm: float, graphs: int = 1) -> dict:
        return {"compile_s": cold, "params": 1000, "graphs": graphs, "steady_step_s": 0.5}

    rows = []
    for layers, ours, theirs in ((2, 5.0, 10.0), (8, 6.0, 20.0)):
        row = runner.Row("debug", layers)
        row.measured = {("torchtitan", "cold"): measured(theirs, 1.0), ("torchtitan", "warm"): measured(1.0, 0),
                        ("torchtitan_lite", "cold"): measured(ours, 1.0), ("torchtitan_lite", "warm"): measured(0.5, 0)}
        row.commands = {"torchtitan": ["tt"], "torchtitan_lite": ["ours"]}
        rows.append(row)
    monkeypatch.setattr(sys, "argv", ["compile_time_bench.py", "--sizes", "debug"])
    args = argparse.Namespace(steps=3, sizes=["debug"], trainers=["torchtitan", "torchtitan_lite"])
    text = runner.report_text(args, rows, {"torchtitan": "0.3.0"}, 0.5, 1.0)
    assert "| `debug` | 2 | 1,000 | 10.0 | 1.0 | 1 | 5.0 | 0.5 | 1 | 1.00x | **0.50x** |" in text
    assert "| `debug` | 8 | 1,000 | 20.0 | 1.0 | 1 | 6.0 | 0.5 | 1 | 1.20x | **0.30x** |" in text
    assert "- `debug` 8 layers, torchtitan_lite: `ours`" in text
