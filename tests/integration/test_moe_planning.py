"""Planning an MoE run at cluster size before launch: --check-config refuses expert-parallel layouts the
model cannot take and names the fix, shows total / active parameters and the EP layout, and --dry-run builds
the 235B-A22B model for 64 GPUs with FSDP 64 x EP 8 and DeepSeek-V3 671B for 256 GPUs with FSDP 256 x EP 8 and
states their per-rank peaks."""
from __future__ import annotations

import re

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.actions import run_action
from torchtitan_lite.config import parse_cli

LAUNCH_ENV = ("WORLD_SIZE", "NGPU", "NPROC", "TTL_GPU_MEMORY_GIB", "TORCHTITAN_LITE_PREFLIGHT",
              "TORCHTITAN_LITE_REQUIRE_DATA")
NO_DATA = ["--tokenizer.path", "none", "--data.dataset", "embedded"]
LAYOUT_235B = ["--parallelism.ep", "8", "--precision.param_dtype", "bfloat16", "--activation_checkpoint.mode", "full",
               "--training.seq_len", "4096", "--training.local_batch_size", "1"]
"""The recommended 64-GPU layout of Qwen3-235B-A22B: FSDP over all 64 ranks, EP 8 (one 8-GPU node's
all-to-all), bf16 compute, full AC, one 4096-token sequence per rank."""


@pytest.fixture
def check(monkeypatch, capsys):
    """--check-config in this process under the given launch environment: (exit status, stdout, stderr)."""
    def run(args: list[str], **env: str) -> tuple[int, str, str]:
        for name in LAUNCH_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        status = run_action(parse_cli([*args, "--check-config"], registry=DEFAULT_REGISTRY), registry=DEFAULT_REGISTRY)
        out, err = capsys.readouterr()
        return status, out, err
    return run


def test_expert_parallelism_of_a_dense_model_is_refused_with_the_fix(check):
    status, _, err = check(["--config", "llama3_debug", *NO_DATA, "--parallelism.ep", "2"], NPROC="2")
    assert status == 2
    assert ("error: parallelism.ep=2 splits routed experts over ranks, but model llama3 (flavor debug) is dense: it "
            "has no MoE layers. Set --parallelism.ep 1 (FSDP shards it over dp_shard), or train an MoE family "
            "(e.g. --config qwen3_moe_debug)") in err


def test_ep_that_does_not_divide_the_experts_is_refused_with_the_divisors(check):
    # ep 3 divides dp_shard 6 (the degrees are valid) but not the debug flavor's 8 experts.
    status, _, err = check(["--config", "qwen3_moe_debug", *NO_DATA, "--parallelism.ep", "3"], NPROC="6")
    assert status == 2
    assert ("error: parallelism.ep=3 must divide the model's num_experts=8 (each EP rank holds whole experts); use "
            "an ep among 1, 2, 4, 8 that also divides dp_shard") in err
    assert check(["--config", "qwen3_moe_debug", *NO_DATA, "--parallelism.ep", "2"], NPROC="6")[0] == 0


def test_expert_parallelism_with_tensor_parallelism_is_accepted_and_its_layout_shown(check):
    status, out, err = check(["--config", "qwen3_moe_debug", *NO_DATA, "--parallelism.ep", "2", "--parallelism.tp",
                              "2"], NPROC="4")
    assert status == 0, err
    assert "is valid for 4 process(es) (FSDP 2 + TP 2 + EP 2)" in out
    assert ("EP 2: 4 experts per rank, their weights not FSDP-sharded (dp_shard 2 / ep 2 = 1), each expert's hidden "
            "dim split over TP 2; tokens travel by all-to-all within each group of 2 EP ranks of one TP coordinate") in out


def test_check_config_shows_total_and_active_parameters_and_the_ep_layout(check):
    status, out, _ = check(["--config", "qwen3_moe_debug", *NO_DATA, "--model.flavor", "235B-A22B", *LAYOUT_235B],
                           NGPU="64")
    assert status == 0, out
    assert "is valid for 64 process(es) (FSDP 64 + EP 8)" in out
    assert "model: 235,093,634,560 parameters, 22,190,763,520 active per token (9.4%" in out
    assert ("experts: 128 routed (top-8, hidden 1536) in 94 of 94 blocks; EP 8: 16 experts per rank, their weights "
            "sharded by FSDP 8 (dp_shard 64 / ep 8)") in out


def test_an_moe_run_that_does_not_fit_is_pointed_to_expert_parallelism(check):
    """235B-A22B on 64 GPUs: 78.5 GiB per rank with FSDP alone, 60.4 GiB with EP 8 (the estimate)."""
    args = ["--config", "qwen3_moe_debug", *NO_DATA, "--model.flavor", "235B-A22B", *LAYOUT_235B[2:]]
    status, _, err = check(args, NGPU="64", TTL_GPU_MEMORY_GIB="70")
    assert status == 2
    assert ("--parallelism.ep 8 (expert parallelism: FSDP gathers and reduce-scatters 1/8 of each block's experts; 8 "
            "divides num_experts=128 and dp_shard=64)") in err
    assert check([*args, *LAYOUT_235B[:2]], NGPU="64", TTL_GPU_MEMORY_GIB="70")[0] == 0


@pytest.mark.parametrize("config", [
    ["--config", "qwen3_moe_debug", "--model.flavor", "235B-A22B"],
    ["--config", "qwen3_moe_235b_fp8"],
], ids=["235B-A22B-flavor", "qwen3_moe_235b_fp8"])
def test_235b_dry_run_on_64_gpus_with_fsdp_64_and_ep_8_fits_80_gib(cli, config):
    result = cli([*config, *LAYOUT_235B, "--dry-run"], NGPU="64")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dry run: rank 0 of 64, FSDP 64 + EP 8" in out
    assert "model: 235,093,634,560 parameters, 22,190,763,520 active per token" in out
    assert "EP 8: 16 experts per rank" in out
    # The estimate sizes exactly the shards the parallelize step produced.
    for label in ("parameters", "gradients", "optimizer states"):
        match = re.search(rf"^  {label}\s+[\d.]+ GiB\s+([\d,]+)\s+\[([\d,]+)\]$", out, re.M)
        assert match and match.group(1) == match.group(2), label
    peak = re.search(r"^total per device\s+([\d.]+)", out, re.M)
    assert peak and float(peak.group(1)) < 80, out[-3000:]


def test_deepseek_v3_671b_dry_run_on_256_gpus_with_fsdp_256_and_ep_8_fits_80_gib(cli):
    """DeepSeek-V3 671B's recommended 256-GPU layout: FSDP over all 256 ranks, EP 8 (each EP group's all-to-all
    within one 8-GPU node). The estimate: 147.0 GiB per rank with FSDP alone, 55.2 GiB with EP 8; EP 16 / 32 / 64
    save only 3.7 / 5.4 / 6.0 GiB more while their all-to-all crosses nodes."""
    result = cli(["--config", "deepseek_v3_671b_fp8", "--parallelism.ep", "8", "--dry-run"], NGPU="256")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dry run: rank 0 of 256, FSDP 256 + EP 8" in out
    assert "model: 671,026,404,352 parameters, 37,552,282,624 active per token" in out
    assert "EP 8: 32 experts per rank, their weights sharded by FSDP 32 (dp_shard 256 / ep 8)" in out
    # The estimate sizes exactly the shards the parallelize step produced.
    for label in ("parameters", "gradients", "optimizer states"):
        match = re.search(rf"^  {label}\s+[\d.]+ GiB\s+([\d,]+)\s+\[([\d,]+)\]$", out, re.M)
        assert match and match.group(1) == match.group(2), label
    peak = re.search(r"^total per device\s+([\d.]+)", out, re.M)
    assert peak and float(peak.group(1)) < 80, out[-3000:]
