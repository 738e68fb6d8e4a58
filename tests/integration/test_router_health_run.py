"""A qwen3_moe_debug run (train.py, one process): TensorBoard carries the router's health per layer and the
console line its summary, with the same numbers."""
from __future__ import annotations

import re

from _cli import TINY, read_scalars

LAYERS = ("layers.0", "layers.1")
SUMMARY = re.compile(r"step\s+(\d+) .* moe imb (\d+\.\d\d) \((layers\.\d)\) dead (\d\.\d\d) aux (\S+)$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_router_health_reaches_tensorboard_and_the_console(cli, tmp_path):
    result = cli(["--config", "qwen3_moe_debug", *TINY, "--training.steps", "3", "--checkpoint.enable", "false",
                  "--metrics.enable_tensorboard", "true", "--metrics.cpu_peak_tflops", "1",
                  "--job.dump_folder", str(tmp_path)], launcher="train.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    scalars = read_scalars(tmp_path / "tb")
    # The debug flavor balances with the auxiliary loss (Qwen3-MoE's 1e-3) and has no expert bias to range over.
    per_layer = {f"moe/{layer}/{stat}" for layer in LAYERS for stat in ("imbalance", "dead_share")}
    assert {tag for tag in scalars if tag.startswith("moe/")} == per_layer | {
        "moe/imbalance_max", "moe/dead_share", "moe/aux_loss"}
    summaries = SUMMARY.findall(ANSI.sub("", result.stdout + result.stderr))
    assert [int(s[0]) for s in summaries] == [1, 2, 3]
    for step, imbalance, worst, dead, aux in summaries:
        step = int(step)
        layers = {layer: scalars[f"moe/{layer}/imbalance"][step] for layer in LAYERS}
        # top-2 of 8 experts: between balanced (1) and every token in the same two experts (8 / 2 = 4).
        assert all(1.0 <= value <= 4.0 for value in layers.values())
        assert scalars["moe/imbalance_max"][step] == max(layers.values())
        assert scalars["moe/dead_share"][step] == sum(scalars[f"moe/{layer}/dead_share"][step] for layer in LAYERS) / 2
        # The console prints the TensorBoard values, rounded to its digits (2 decimals, 3 significant for aux).
        assert worst == max(layers, key=layers.__getitem__)
        assert float(imbalance) == round(scalars["moe/imbalance_max"][step], 2)
        assert float(dead) == round(scalars["moe/dead_share"][step], 2)
        assert float(aux) == float(f"{scalars['moe/aux_loss'][step]:.3g}")
        # Coefficient 1e-3 times the per-layer loss, which is >= ~1 (1 when balanced), summed over 2 layers.
        assert 1.9e-3 < scalars["moe/aux_loss"][step] < 8.1e-3
