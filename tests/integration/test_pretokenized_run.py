"""A run that reads a store written by scripts/pretokenize.py trains exactly as one that tokenises the same
files itself (into its cache): the same losses, step by step."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from _cli import TINY, read_scalars

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from torchtitan_lite.tools import pretokenize  # noqa: E402


def test_pretokenized_and_on_the_fly_runs_train_the_same_losses(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n"
                            for i in range(300)))
    assert pretokenize.main(["--dataset", str(docs), "--output", str(tmp_path / "tokens"), "--workers", "1"]) == 0
    losses = {}
    for name, extra in [("on_the_fly", []), ("pretokenized", ["--data.token_store", str(tmp_path / "tokens")])]:
        dump = tmp_path / name
        assert train.main(["--config", "llama3_debug", *TINY, "--data.dataset", str(docs), "--training.steps", "20",
                           "--checkpoint.enable", "false", "--metrics.cpu_peak_tflops", "1",
                           "--job.dump_folder", str(dump), *extra]) == 0
        losses[name] = read_scalars(dump / "tb")["train/loss"]
    assert sorted(losses["on_the_fly"]) == list(range(1, 21))
    assert losses["pretokenized"] == losses["on_the_fly"]
