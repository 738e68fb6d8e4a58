"""Multi-process launches through run_train.sh on CPU (gloo)."""
from __future__ import annotations

from _cli import read_scalars

TINY = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.log_freq", "1"]


def test_fsdp2_fp8_trains_with_nproc_2(cli, tmp_path):
    result = cli(["--config", "llama3_debug_fp8", "--parallelism.dp_shard", "2", "--training.steps", "4",
                  *TINY, "--job.dump_folder", str(tmp_path)], NPROC="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FSDP 2" in result.stdout
    losses = read_scalars(tmp_path / "tb")["train/loss"]
    assert set(losses) == {1, 2, 3, 4} and losses[4] < losses[1]


def test_wrong_degrees_fail_before_any_process_starts(cli, tmp_path):
    result = cli(["--parallelism.tp", "3", "--job.dump_folder", str(tmp_path)], NPROC="2")
    assert result.returncode == 2
    assert "world size 2" in result.stderr and "tp = 1 x 3 = 3" in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started
