"""A run on a weighted mixture writes each source's tokens and validation loss to TensorBoard."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from _cli import TINY, read_scalars  # noqa: E402

import train  # noqa: E402


def _write(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_a_mixture_logs_tokens_and_validation_loss_per_source(tmp_path):
    code = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(60)]
    prose = [f"On day {i} the river was {'calm' if i % 2 else 'high'} and the boats stayed in." for i in range(60)]
    sources = {"code": (3, code), "prose": (1, prose)}
    tables = "".join(
        f'[[data.sources]]\nname = "{name}"\nweight = {weight}\n'
        f'dataset = "{_write(tmp_path / f"{name}.jsonl", texts[:50])}"\n'
        f'validation_files = "{_write(tmp_path / f"{name}-val.jsonl", texts[50:])}"\n\n'
        for name, (weight, texts) in sources.items())
    (tmp_path / "mixture.toml").write_text(tables)
    dump = tmp_path / "run"
    assert train.main([*TINY, "--training.steps", "4", "--validation.enable", "true", "--validation.freq", "4",
                       "--validation.steps", "2", "--job.dump_folder", str(dump),
                       "--config-file", str(tmp_path / "mixture.toml")]) == 0
    scalars = read_scalars(dump / "tb")
    # Step 4 read 4 x 2 windows of 32 tokens, about 3:1 (8 positions are inside the first block of 64).
    tokens = {name: scalars[f"data/tokens/{name}"][4] for name in sources}
    assert sum(tokens.values()) == 4 * 2 * 32 and 4 * 32 <= tokens["code"] <= 7 * 32
    losses = {name: scalars[f"val/loss/{name}"] for name in sources}
    assert set(losses["code"]) == set(losses["prose"]) == {0, 4}
    for step in (0, 4):
        overall = (3 * losses["code"][step] + losses["prose"][step]) / 4
        assert abs(scalars["val/loss"][step] - overall) < 1e-4
    assert losses["code"][4] != losses["prose"][4]
