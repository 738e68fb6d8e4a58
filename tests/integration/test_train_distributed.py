"""Multi-process launches through run_train.sh on CPU (gloo)."""
from __future__ import annotations

import shutil

import pytest
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


def test_tp2_without_sequence_parallel_trains_with_the_fused_optimizer(cli, tmp_path):
    # Without SP the norms' weights stay plain tensors beside DTensor Linear weights; the fused AdamW
    # kernel refuses a mixed list, so the optimizer keeps them in separate groups.
    result = cli(["--parallelism.tp", "2", "--parallelism.enable_sequence_parallel", "false",
                  "--optimizer.implementation", "fused", "--training.steps", "3", *TINY,
                  "--job.dump_folder", str(tmp_path)], NPROC="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "AdamW fused" in result.stdout
    assert set(read_scalars(tmp_path / "tb")["train/loss"]) == {1, 2, 3}


def test_wrong_degrees_fail_before_any_process_starts(cli, tmp_path):
    result = cli(["--parallelism.tp", "3", "--job.dump_folder", str(tmp_path)], NPROC="2")
    assert result.returncode == 2
    assert "world size 2" in result.stderr and "pp x dp_replicate x tp = 1 x 1 x 3 = 3" in result.stderr
    assert "torch.distributed.run" not in result.stderr  # torchrun never started


def test_two_torchrun_nodes_on_localhost_train_together(tmp_path):
    """Two torchrun 'nodes' meet through c10d rendezvous on localhost, as scripts/slurm_multinode.sh does."""
    import socket
    import subprocess
    import sys

    from _cli import ROOT, _env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = ["bash", str(ROOT / "scripts" / "torchrun_graceful.sh"), sys.executable, "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "ttl-two-nodes",
            str(ROOT / "train.py"), "--parallelism.dp_shard", "2", "--training.steps", "3", *TINY,
            "--job.dump_folder", str(tmp_path)]
    nodes = [subprocess.Popen(node, cwd=ROOT, env=_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    losses = read_scalars(tmp_path / "tb")["train/loss"]
    assert set(losses) == {1, 2, 3}


def test_fsdp2_blockwise_trains_with_the_fp8_all_gather(cli, tmp_path):
    # llama3_debug's wk / wv have 128 output rows: 64 per FSDP shard cut every block, so they (and only they)
    # are gathered in bf16; the other five Linears of each block gather FP8 blocks.
    result = cli(["--config", "llama3_debug_fp8_blockwise", "--parallelism.dp_shard", "2", "--training.steps", "5",
                  *TINY, "--job.dump_folder", str(tmp_path)], NPROC="2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert ("FSDP all-gather (dp_shard=2): 10 of 14 blockwise Linears gather FP8 blocks (1.00024 bytes/element: "
            "E4M3 + a float32 scale per block)") in log
    assert ("FP8: layers.*.attention.wq, layers.*.attention.wo, layers.*.feed_forward.w1, layers.*.feed_forward.w2, "
            "layers.*.feed_forward.w3") in log
    assert "high precision: layers.*.attention.wk, layers.*.attention.wv (128 rows / dp_shard=2 = 64 rows" in log
    losses = read_scalars(tmp_path / "tb")["train/loss"]
    assert set(losses) == {1, 2, 3, 4, 5} and losses[5] < losses[1]


def test_qwen3_moe_with_tensor_parallel_2_trains_as_one_process_from_the_same_seed_checkpoint(cli, tmp_path):
    """The MoE family under TP 2 (attention split by heads, the MoE expert tensor parallel), through the CLI:
    from one seed checkpoint its losses are the 1-process run's. (Without one each TP rank draws the same
    numbers for its shard, which is another initial model.)"""
    seed = ["--config", "qwen3_moe_debug", *TINY, "--checkpoint.enable", "true"]
    # One process runs train.py itself: run_train.sh's preflight and torchrun start-up would only add seconds.
    made = cli([*seed, "--checkpoint.create_seed_checkpoint", "true", "--job.dump_folder", str(tmp_path / "seed")],
               launcher="train.py")
    assert made.returncode == 0, made.stderr[-3000:]
    losses = {}
    for name, extra in {"one": (), "tp2": ("--parallelism.tp", "2")}.items():
        shutil.copytree(tmp_path / "seed" / "checkpoint", tmp_path / name / "checkpoint")
        result = cli([*seed, *extra, "--training.steps", "5", "--job.dump_folder", str(tmp_path / name)],
                     NPROC="2" if extra else "1", launcher="run_train.sh" if extra else "train.py")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        scalars = read_scalars(tmp_path / name / "tb")
        losses[name] = scalars["train/loss"]
        assert set(scalars["moe/imbalance_max"]) == {1, 2, 3, 4, 5}  # the router's health is reported
    assert "parallelized qwen3_moe: TP 2, SP, loss parallel, expert TP 2" in result.stdout + result.stderr
    assert set(losses["tp2"]) == {1, 2, 3, 4, 5}
    # float32: only the order of sums differs (TP partial products); measured 1.2e-7 relative.
    for step, loss in losses["one"].items():
        assert losses["tp2"][step] == pytest.approx(loss, rel=1e-5), step
