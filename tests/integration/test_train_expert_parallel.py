"""`NPROC=2 ./run_train.sh --config qwen3_moe_debug --parallelism.ep 2` trains, and from the same initial
weights (a 1-process seed checkpoint) its losses equal those of FSDP 2 without EP: the same ranks read the
same data, so EP alone differs. (The 1-process comparison with identical data is
tests/distributed/test_expert_parallel.py; one process reads its micro-batches in another order than two
ranks read theirs.)"""
from __future__ import annotations

from _cli import read_scalars

STEPS = 4
RUN = ["--config", "qwen3_moe_debug", "--training.steps", str(STEPS), "--training.seq_len", "64",
       "--validation.enable", "false", "--metrics.log_freq", "1"]
# float32: EP changes only the order of sums (measured over 20 steps of this command at seq_len 128:
# 7.6e-8 relative at most).
FP32_RTOL = 1e-6


def test_ep2_trains_through_run_train_sh_like_fsdp2_from_the_same_seed(cli, tmp_path):
    # The seed is one process: train.py itself, without run_train.sh's preflight and torchrun start-up.
    seed = cli([*RUN, "--checkpoint.enable", "true", "--checkpoint.create_seed_checkpoint", "true",
                "--job.dump_folder", str(tmp_path / "seed")], launcher="train.py")
    assert seed.returncode == 0, seed.stdout[-3000:] + seed.stderr[-3000:]
    from_seed = ["--checkpoint.enable", "true", "--checkpoint.interval", "1000",
                 "--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0")]
    losses = {}
    for name, layout in (("ep2", ["--parallelism.ep", "2"]), ("fsdp2", ["--parallelism.dp_shard", "2"])):
        result = cli([*RUN, *from_seed, *layout, "--job.dump_folder", str(tmp_path / name)], NPROC="2")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[name] = read_scalars(tmp_path / name / "tb")["train/loss"]
        if name == "ep2":
            assert "FSDP 2 + EP 2, experts split over EP 2" in result.stdout + result.stderr
    assert set(losses["ep2"]) == set(range(1, STEPS + 1))
    assert losses["ep2"][STEPS] < losses["ep2"][1]
    for step, loss in losses["fsdp2"].items():
        assert abs(losses["ep2"][step] - loss) <= FP32_RTOL * loss, (step, losses)
