"""The default config trains end to end through run_train.sh and leaves readable outputs."""
from __future__ import annotations

import tomllib
from _cli import read_scalars


def test_default_config_trains_and_logs_every_logged_step(cli, tmp_path):
    result = cli(["--training.steps", "12", "--optimizer.lr", "1e-3", "--metrics.log_freq", "3",
                  "--validation.freq", "6", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    saved = tomllib.loads((tmp_path / "config.toml").read_text())
    assert saved["training"]["steps"] == 12 and saved["optimizer"]["lr"] == 1e-3

    scalars = read_scalars(tmp_path / "tb")
    logged = {1, 3, 6, 9, 12}
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_second", "train/tflops",
                "train/mfu", "train/memory_gib"):
        assert set(scalars[tag]) == logged, tag
    assert set(scalars["val/loss"]) == {0, 6, 12}
    # train/loss is the mean since the previous log line, train/loss_step the logged step's own: one step in the
    # first interval, three since (a mean of three steps is not the last step's loss).
    assert set(scalars["train/loss_step"]) == logged
    assert scalars["train/loss"][1] == scalars["train/loss_step"][1]
    assert all(scalars["train/loss"][s] != scalars["train/loss_step"][s] for s in (3, 6, 9, 12))
    # The peak lr given on the command line is reached after warmup and never exceeded.
    assert max(scalars["train/lr"].values()) <= 1e-3 * (1 + 1e-6)
    assert scalars["train/loss"][12] < scalars["train/loss"][1]
    assert scalars["val/loss"][12] < scalars["val/loss"][0]
    assert all(v > 0 for v in scalars["train/tokens_per_second"].values())
