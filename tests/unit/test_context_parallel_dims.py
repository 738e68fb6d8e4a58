"""The cp degree in ParallelDims: it takes its share of the world, places every rank in the (pp, dp_replicate,
dp_shard, cp, tp) grid, folds into FSDP, checks the sequence split, and names itself only when it is on. Until
context-parallel attention exists, resolve_run refuses cp > 1."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import config_registry
import models  # noqa: F401  (registers the families)
from models.llama3.model import Llama3ModelArgs
from torchtitan_lite.config.sections import ParallelismConfig
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.resolved_run import resolve_run

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=128)


def test_dp_shard_minus_one_fills_after_cp_and_cp_folds_into_fsdp():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=32, cp=2, pp=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 2, 2, 2)
    assert dims.dp_degree == 4 and dims.cp_enabled and dims.fsdp_enabled
    assert dims.describe() == "PP 2 + HSDP 2x2 + CP 2 + TP 2"
    # CP alone: one data shard, yet the two CP ranks hold the same weights and FSDP shards over them.
    alone = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=2, cp=2)
    assert (alone.dp_shard, alone.dp_degree, alone.dp_enabled, alone.fsdp_enabled) == (1, 1, False, True)
    assert alone.describe() == "CP 2"
    assert "cp=2" in repr(alone) and "cp=" not in repr(ParallelDims(1, 2, 1, world_size=2))


def test_cp_one_names_nothing_new():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert (dims.cp, dims.cp_enabled) == (1, False)
    assert dims.describe() == "HSDP 2x4 + TP 2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_replicate=1, dp_shard=-1, tp=1, world_size=2, cp=0), "parallelism.cp=0 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=2, tp=1, world_size=8, cp=2),
     "pp x dp_replicate x dp_shard x cp x tp = 1 x 1 x 2 x 2 x 1 = 4 must equal the world size 8"),
    (dict(dp_replicate=1, dp_shard=-1, tp=2, world_size=12, cp=4),
     "dp_shard=-1 cannot fill world size 12: it is not divisible by pp x dp_replicate x cp x tp = 1 x 1 x 4 x 2 = 8"),
    (dict(dp_replicate=1, dp_shard=0, tp=1, world_size=2, cp=2), "or -1 to use the ranks left after pp, dp_replicate, "
     "cp and tp"),
    (dict(dp_replicate=1, dp_shard=-1, tp=1, world_size=6, cp=2, ep=2),
     "leave parallelism.dp_shard=3 after pp x dp_replicate x cp x tp = 1 x 1 x 2 x 1 = 2: this layout needs 8 "
     "processes (pp x dp_replicate x dp_shard x cp x tp = 1 x 1 x 4 x 2 x 1; any multiple of 4 runs)"),
])
def test_bad_degrees_with_cp_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("rank, expected", [
    # pp 2 x dp_shard 2 x cp 2 x tp 2 on 16 ranks, tp innermost, then cp, then dp, pp outermost.
    (0, (0, 0, 0)), (1, (0, 0, 0)), (2, (0, 1, 0)), (3, (0, 1, 0)), (4, (1, 0, 0)), (6, (1, 1, 0)),
    (7, (1, 1, 0)), (8, (0, 0, 1)), (10, (0, 1, 1)), (13, (1, 0, 1)), (15, (1, 1, 1)),
])
def test_ranks_in_the_grid(monkeypatch, rank, expected):
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=16, cp=2, pp=2)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    assert (dims.dp_rank, dims.cp_rank, dims.pp_rank) == expected


@pytest.mark.parametrize("cp, tp, seq_len, sp, message", [
    (2, 1, 90, True, "training.seq_len=90 must be divisible by 2 x parallelism.cp = 4: context parallelism cuts "
                     "each sequence into 2 x cp load-balanced chunks; use a seq_len that is a multiple of 4, or a "
                     "cp that divides seq_len / 2"),
    (4, 1, 36, False, "training.seq_len=36 must be divisible by 2 x parallelism.cp = 8"),
    (2, 4, 36, True, "training.seq_len / parallelism.cp = 36 / 2 = 18 tokens per rank must be divisible by "
                     "parallelism.tp=4 when sequence parallelism shards them; change seq_len or set "
                     "parallelism.enable_sequence_parallel=false"),
])
def test_sequence_must_split_over_cp(cp, tp, seq_len, sp, message):
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=tp, world_size=cp * tp, cp=cp)
    with pytest.raises(ValueError) as e:
        dims.validate_for_model(ARGS, seq_len, sequence_parallel=sp)
    assert message in str(e.value)


def test_sequence_split_accepts_what_divides():
    assert ParallelDims(1, 1, 4, world_size=8, cp=2).validate_for_model(ARGS, 40, sequence_parallel=True) is None
    assert ParallelDims(1, 1, 4, world_size=8, cp=2).validate_for_model(ARGS, 36, sequence_parallel=False) is None
    # cp=1 keeps the old rule: 90 is no multiple of 2, but one rank holds the whole sequence.
    assert ParallelDims(1, 1, 1, world_size=1).validate_for_model(ARGS, 91) is None


def test_config_field_is_checked():
    assert ParallelismConfig().cp == 1
    with pytest.raises(ValueError, match="parallelism.cp=0 must be >= 1"):
        ParallelismConfig(cp=0)


def test_resolve_run_sizes_the_linears_by_the_rank_s_chunk():
    """Under CP a rank's Linears see seq_len / cp tokens of each sequence, and FSDP shards over dp_shard x cp."""
    config = config_registry.get("llama3_debug_fp8")
    config.parallelism.cp = 2
    run = resolve_run(config, world_size=4, device_type="cpu", vocab_size=2048)
    assert (run.parallel_dims.cp, run.parallel_dims.dp_shard) == (2, 2)
    assert run.tokens_per_forward == config.training.seq_len // 2 * config.training.local_batch_size
    assert run.converters.converters[0].context.dp_shard == 4
    config.parallelism.cp = 1
    run = resolve_run(config, world_size=4, device_type="cpu", vocab_size=2048)
    assert run.tokens_per_forward == config.training.seq_len * config.training.local_batch_size
    assert run.converters.converters[0].context.dp_shard == 4
