"""--dry-run at cluster size: the real build and parallelize of rank 0 over a fake process group, with
per-rank bytes read off the DTensor shards, in one CPU process (no GPU, no real ranks)."""
from __future__ import annotations

import re

import pytest

GIB = 1024**3


def _bytes(stdout: str, label: str) -> tuple[int, int]:
    """(shard bytes, the estimate's bytes) of a 'per-rank bytes read off the DTensor shards' row."""
    match = re.search(rf"^  {label}\s+[\d.]+ GiB\s+([\d,]+)\s+\[([\d,]+)\]$", stdout, re.M)
    assert match, f"no {label} row in:\n{stdout[:2000]}"
    return int(match.group(1).replace(",", "")), int(match.group(2).replace(",", ""))


def _peak_gib(stdout: str) -> float:
    match = re.search(r"^total per device\s+([\d.]+)", stdout, re.M)
    assert match, stdout[-2000:]
    return float(match.group(1))


def _dry_run(cli, config: str, ngpu: int, *extra: str, action: str = "--dry-run"):
    result = cli(["--config", config, *extra, action], launcher="train.py", NGPU=str(ngpu), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # The estimate sizes exactly the shards the real parallelize step produced.
    for label in ("parameters", "gradients", "optimizer states"):
        shards, estimated = _bytes(result.stdout, label)
        assert shards == estimated, label
    return result.stdout


@pytest.mark.slow
def test_8b_fp8_on_8_gpus_with_tp_2_uses_float8_tp_for_the_ffn_and_wo(cli):
    out = _dry_run(cli, "llama3_8b_fp8", 8, "--parallelism.tp", "2")
    assert "dry run: rank 0 of 8, FSDP 4 + TP 2" in out
    # auto_filter_small_kn keeps wk/wv in bf16: their shared input stays bf16, every other region is float8.
    assert re.search(r"attention input\s+bfloat16\s+\(attention.wk, attention.wv not tensorwise float8; every block\)",
                     out)
    for region in ("feed_forward input", "attention.wo output", "feed_forward.w2 output"):
        assert re.search(rf"{region}\s+float8\s+\(.*; every block\)", out), region
    params, _ = _bytes(out, "parameters")
    # 8,030,261,248 fp32 parameters over 8 ranks, plus FSDP's padding of rank 0's shards (< 0.1%).
    assert 8_030_261_248 * 4 / 8 <= params < 8_030_261_248 * 4 / 8 * 1.001


@pytest.mark.slow
def test_8b_mxfp8_on_8_gpus_with_tp_2_keeps_tp_communication_in_bfloat16(cli):
    out = _dry_run(cli, "llama3_8b_mxfp8", 8, "--parallelism.tp", "2", action="--dry-run-detail")
    assert "dry run: rank 0 of 8, FSDP 4 + TP 2" in out
    assert "FP8 plan: 224 of 225 Linear layers run in FP8" in out
    assert re.search(r"^output\s+4096\s+128256\s+-\s+output projection \(keep_output_hp\)$", out, re.M)
    # MX scales are per 32-element block, so TP gathers activations and gradients in bfloat16.
    for region in ("attention input", "feed_forward input", "attention.wo output", "feed_forward.w2 output"):
        assert re.search(rf"{region}\s+bfloat16\s+\(.*; every block\)", out), region


@pytest.mark.slow
def test_70b_fp8_on_64_gpus_with_tp_8(cli):
    out = _dry_run(cli, "llama3_70b_fp8", 64, "--parallelism.tp", "8")
    assert "dry run: rank 0 of 64, FSDP 8 + TP 8" in out
    assert _peak_gib(out) < 80


def test_405b_fp8_on_512_gpus_with_tp_8_and_hsdp_fits_80_gib(cli):
    """The layout the README recommends for 405B: TP 8 within a node, HSDP 4 x 16 across nodes (its documented
    dry-run command, which test_docs_commands.py leaves to this test)."""
    out = _dry_run(cli, "llama3_405b_fp8", 512, "--parallelism.tp", "8", "--parallelism.dp_replicate", "4")
    assert "dry run: rank 0 of 512, HSDP 4x16 + TP 8" in out
    assert "FP8 plan: 882 of 883 Linear layers run in FP8" in out
    assert _peak_gib(out) < 80
    # A summary, not 883 table rows: the tables come with --dry-run-detail.
    assert len(out.splitlines()) < 80 and "skipped because" not in out
    assert "every Linear with its recipe or skip reason: --dry-run-detail" in out


def test_qwen3_moe_with_fsdp_2_x_tp_2_sizes_the_expert_shards_it_builds(cli):
    """The experts' 3-D weights split on their hidden dim by TP and on the expert dim by FSDP: the estimate
    reads the same shard shapes off the plan as the build produces (checked by _dry_run)."""
    out = _dry_run(cli, "qwen3_moe_debug", 4, "--parallelism.dp_shard", "2", "--parallelism.tp", "2")
    assert "dry run: rank 0 of 4, FSDP 2 + TP 2" in out
    params, _ = _bytes(out, "parameters")
    assert params == 2_304_768  # 4 layers of 8 experts [8, 128, 128] x 3 and the rest, over 4 ranks, in fp32


def test_a_dry_run_prints_a_summary_and_the_detail_flag_adds_the_fp8_tables(cli):
    """The FP8 plan's tables (a row per Linear and expert weight: hundreds of lines for a large model) come with
    --dry-run-detail; --dry-run prints their summary."""
    args = ("--parallelism.dp_shard", "2", "--parallelism.tp", "2")
    summary = _dry_run(cli, "qwen3_moe_debug_fp8", 4, *args)
    detail = _dry_run(cli, "qwen3_moe_debug_fp8", 4, *args, action="--dry-run-detail")
    assert len(summary.splitlines()) < 60, summary
    assert "skipped because" not in summary and "high precision because" not in summary
    assert "FP8 plan: 16 of 21 Linear layers run in FP8" in summary
    assert "moe_experts converter (rowwise, emulated): 12 of 12 expert grouped GEMMs in rowwise" in summary
    assert summary.count("--dry-run-detail") == 2  # the Linears' line and the experts' line
    # The detail: every Linear and expert weight in a row of its own, then the same rest of the report.
    for row in (r"^layers\.0\.attention\.wq\s+128\s+128\s+rowwise$", r"^layers\.0\.moe\.experts\.w1\s+8\s+128\s+128\s+rowwise"):
        assert re.search(row, detail, re.M) and not re.search(row, summary, re.M), row
    assert len(detail.splitlines()) > len(summary.splitlines()) + 21 + 12
    assert summary.splitlines()[-10:] == detail.splitlines()[-10:]  # the memory estimate, in both



def test_405b_fp8_at_128k_with_cp_16_names_cp_and_the_per_rank_peak(cli):
    """README's long-context layout: 131072-token windows under a document mask on 1024 GPUs, TP 8 in each node
    x CP 16 x FSDP 8 (FSDP shards over dp_shard x cp = 128, as the shards read back show). A rank holds 8192
    tokens of each sequence and gathers the keys and values of all 131072 per layer."""
    out = _dry_run(cli, "llama3_405b_fp8", 1024, "--training.seq_len", "131072", "--parallelism.cp", "16",
                   "--parallelism.tp", "8", "--training.local_batch_size", "1", "--model.attention_mask", "document")
    assert "dry run: rank 0 of 1024, FSDP 8 + CP 16 + TP 8" in out
    # K/V: 131072 tokens x 2 x 1 KV head per TP rank x 128 channels x 2 bytes = 64 MiB per layer.
    assert ("CP 16: 8192 tokens per rank of each 131072-token sequence (2 x 16 head-tail chunks), K/V gathered "
            "64.0 MiB/layer") in out
    assert "8192 tokens/micro-batch" in out and "sharded TP 8 x FSDP 128 (dp_shard 8 x cp 16)" in out
    assert re.search(r"^peak allocated\s+[\d.]+\s+[\d,]+\s+at ", out, re.M)
    assert _peak_gib(out) < 0.85 * 80  # 15% headroom on an 80 GiB GPU
