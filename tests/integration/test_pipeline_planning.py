"""Planning a pipeline-parallel run at cluster size before launch: --dry-run builds one rank of every pipeline
coordinate (its stages cut and parallelized as the trainer does it) for Llama 3 405B on 2048 GPUs (PP 8 x
FSDP 32 x TP 8) and DeepSeek-V3 671B on 1024 GPUs (PP 8 x FSDP 128 x EP 32), prints every pipeline rank's
shard bytes beside the estimate's and its estimated peak, and names the largest rank."""
from __future__ import annotations

import re

LAYOUT_405B = ["--config", "llama3_405b_fp8", "--parallelism.pp", "8", "--parallelism.tp", "8",
               "--parallelism.pipeline_schedule", "Interleaved1F1B", "--training.local_batch_size", "16"]
"""The README's 405B layout on 2048 GPUs, its dry-run command exactly (test_docs_commands.py leaves it to this
test): TP 8 in a node, 8 pipeline stages of nodes, FSDP 32 over the rest; 16 micro-batches of one 8192-token
sequence (pipeline_microbatch_size 1, the default) per local batch, 2 stages per rank."""
LAYOUT_671B = ["--config", "deepseek_v3_671b_fp8", "--parallelism.pp", "8", "--parallelism.ep", "32",
               "--parallelism.pipeline_schedule", "1F1B", "--training.local_batch_size", "16",
               "--parallelism.pipeline_microbatch_size", "1"]
"""DeepSeek-V3 on 1024 GPUs: EP 32 keeps the experts that each pipeline rank accumulates unsharded gradients of
down to 8 per MoE layer (EP 8: 32, and 95.6 GiB for rank 1 of PP 8 x EP 8 on 2048 GPUs by the estimate)."""


def _pipeline_ranks(out: str, pp: int) -> dict[int, float]:
    """Every pp rank's shard bytes equal the estimate's; returns each rank's estimated GiB per device."""
    totals = {}
    blocks = re.split(r"^pp rank (\d+) \(", out, flags=re.M)[1:]
    assert len(blocks) == 2 * pp, out[:3000]
    for rank, text in zip(blocks[::2], blocks[1::2], strict=True):
        peak = re.search(r"estimated peak [\d.]+ GiB allocated, ([\d.]+) GiB per device:", text)
        assert peak, text[:500]
        totals[int(rank)] = float(peak.group(1))
        for label in ("parameters", "gradients", "optimizer states"):
            match = re.search(rf"^  {label}\s+[\d.]+ GiB\s+([\d,]+)\s+\[([\d,]+)\]$", text, re.M)
            assert match and match.group(1) == match.group(2), (rank, label)
    return totals


def _largest(out: str) -> tuple[int, float]:
    match = re.search(r"^largest: pp rank (\d+) \(.*\), ([\d.]+) GiB per device$", out, re.M)
    assert match, out[-3000:]
    return int(match.group(1)), float(match.group(2))


def test_405b_dry_run_on_2048_gpus_with_pp_8_tp_8_prints_every_pipeline_rank(cli):
    result = cli([*LAYOUT_405B, "--dry-run"], NGPU="2048", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dry run: one rank of each of the 8 pipeline coordinates of 2048, PP 8 + FSDP 32 + TP 8" in out
    assert "pipeline: PP 8 (Interleaved1F1B, 16 stages, 2 per rank, 16 micro-batches of 1)" in out
    assert "pp rank 0 (stage 0: embedding + blocks 0-6; stage 8: blocks 63-70)" in out
    assert "pp rank 7 (stage 7: blocks 55-62; stage 15: blocks 119-125 + head)" in out
    totals = _pipeline_ranks(out, 8)
    # Rank 0 holds the most micro-batches in flight (23 under Interleaved1F1B) and the embedding.
    assert "at most 23 micro-batches held at once (stage 0 16, stage 8 8)" in out
    assert _largest(out) == (0, max(totals.values())) and totals[0] == max(totals.values())
    assert max(totals.values()) < 80


def test_deepseek_v3_dry_run_on_1024_gpus_with_pp_8_and_ep_32_fits_80_gib(cli):
    result = cli([*LAYOUT_671B, "--dry-run"], NGPU="1024", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "dry run: one rank of each of the 8 pipeline coordinates of 1024, PP 8 + FSDP 128 + EP 32" in out
    assert "EP 32: 8 experts per rank, their weights sharded by FSDP 4 (dp_shard 128 / ep 32)" in out
    totals = _pipeline_ranks(out, 8)
    rank, total = _largest(out)
    assert total == max(totals.values()) == totals[rank]
    assert total < 80
