"""`NPROC=2 ./run_train.sh --config deepseek_v3_debug --parallelism.pp 2` with Interleaved1F1B trains: the dense
first block and the MoE blocks on four stages, two per rank (rank 0: the embedding and dense block 0, then MoE
block 2; rank 1: MoE block 1, then MoE block 3 and the head), the balance loss entering through the MoE layers
(both balancing schemes of the debug flavor on), and the router statistics of every stage's layers merged
(within each rank, then over the pipeline group) and logged by every rank as one model's.
(The comparison with one process on identical data is tests/distributed/test_moe_pipeline.py.)"""
from __future__ import annotations

import math
import re

from _cli import read_scalars

STEPS = 3
RUN = ["--config", "deepseek_v3_debug", "--parallelism.pp", "2", "--parallelism.pipeline_schedule", "Interleaved1F1B",
       "--training.steps", str(STEPS),
       "--training.seq_len", "32", "--training.local_batch_size", "2", "--validation.enable", "false",
       "--metrics.log_freq", "1", "--checkpoint.enable", "false"]
MOE_LAYERS = ("layers.1", "layers.2", "layers.3")
"""deepseek_v3 debug: block 0 dense, blocks 1-3 MoE."""


def test_deepseek_v3_pp2_trains_and_reports_every_stages_routers(cli, tmp_path):
    result = cli([*RUN, "--job.dump_folder", str(tmp_path)], NPROC="2")
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "this rank runs stage 0: embedding + block 0, stage 2: block 2" in log
    scalars = read_scalars(tmp_path / "tb")
    losses = scalars["train/loss"]
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    per_layer = {f"moe/{layer}/{stat}" for layer in MOE_LAYERS for stat in ("imbalance", "dead_share", "bias_min",
                                                                            "bias_max")}
    assert {tag for tag in scalars if tag.startswith("moe/")} == per_layer | {
        "moe/imbalance_max", "moe/dead_share", "moe/aux_loss"}
    for step in losses:
        imbalances = [scalars[f"moe/{layer}/imbalance"][step] for layer in MOE_LAYERS]
        assert scalars["moe/imbalance_max"][step] == max(imbalances)
        # Coefficient 1e-4 times each layer's loss (>= 1, 1 when balanced), summed over the 3 layers of both stages.
        assert 2.9e-4 < scalars["moe/aux_loss"][step] < 3e-3
    # The bias moved after the first applied step on both stages' layers.
    assert all(scalars[f"moe/{layer}/bias_min"][STEPS] < 0 < scalars[f"moe/{layer}/bias_max"][STEPS] for layer in MOE_LAYERS)
    console = [line for line in log.splitlines() if re.search(r"step +\d+ +loss", line)]
    assert len(console) == STEPS and all(" moe imb " in line and " aux " in line for line in console)
