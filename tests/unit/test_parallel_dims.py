"""ParallelDims: degrees are validated as plain numbers, before any process group exists."""
from __future__ import annotations

import pytest

from models.llama3.model import Llama3ModelArgs
from torchtitan_lite.mesh.parallel_dims import ParallelDims

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=128)


def test_dp_shard_minus_one_takes_the_remaining_ranks():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 4, 2)
    assert dims.dp_degree == 8 and dims.fsdp_enabled and dims.hsdp_enabled and dims.tp_enabled
    assert dims.describe() == "HSDP 2x4 + TP 2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_replicate=1, dp_shard=2, tp=2, world_size=8),
     "pp x dp_replicate x dp_shard x tp = 1 x 1 x 2 x 2 = 4 must equal the world size 8"),
    (dict(dp_replicate=1, dp_shard=2, tp=1, world_size=8, pp=2),
     "pp x dp_replicate x dp_shard x tp = 2 x 1 x 2 x 1 = 4 must equal the world size 8"),
    (dict(dp_replicate=1, dp_shard=1, tp=1, world_size=2, pp=0), "parallelism.pp=0 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=-1, tp=3, world_size=8),
     "dp_shard=-1 cannot fill world size 8: it is not divisible by pp x dp_replicate x tp = 1 x 1 x 3 = 3"),
    (dict(dp_replicate=0, dp_shard=-1, tp=1, world_size=2), "parallelism.dp_replicate=0 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=-1, tp=-2, world_size=2), "parallelism.tp=-2 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=0, tp=1, world_size=2), "parallelism.dp_shard=0 must be a positive integer, or -1"),
    (dict(dp_replicate=1, dp_shard=-3, tp=1, world_size=2), "parallelism.dp_shard=-3 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=1, tp=1, world_size=0), "world_size=0 must be a positive integer"),
    (dict(dp_replicate=1, dp_shard=2, tp=1, world_size=2, ep=4),
     "parallelism.ep=4 must divide parallelism.dp_shard=2: expert parallelism splits the experts over"),
    (dict(dp_replicate=1, dp_shard=-1, tp=1, world_size=2, ep=0), "parallelism.ep=0 must be a positive integer"),
    # pp 2 x ep 2 on 2 processes: dp_shard fills to 1, and the fix is 4 processes, not a bigger dp_shard.
    (dict(dp_replicate=1, dp_shard=-1, tp=1, world_size=2, ep=2, pp=2),
     "parallelism.ep=2 splits the experts over data-parallel (FSDP) ranks, and 2 process(es) leave "
     "parallelism.dp_shard=1 after pp x dp_replicate x tp = 2 x 1 x 1 = 2: this layout needs 4 processes (pp x "
     "dp_replicate x dp_shard x tp = 2 x 1 x 2 x 1); launch 4 (NPROC=4, or NGPU=4 on GPUs) or drop expert "
     "parallelism (ep=1)"),
    (dict(dp_replicate=1, dp_shard=-1, tp=2, world_size=12, ep=4, pp=1),
     "this layout needs 16 processes (pp x dp_replicate x dp_shard x tp = 1 x 1 x 8 x 2; any multiple of 8 runs); "
     "launch 16 (NPROC=16, or "
     "NGPU=16 on GPUs) or use an ep that divides 6"),
])
def test_bad_degrees_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value)


def test_ep_borrows_from_dp_shard_and_leaves_the_rest_for_expert_fsdp():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=32, ep=4)
    assert (dims.dp_shard, dims.ep, dims.expert_fsdp_degree) == (8, 4, 2)
    assert dims.ep_enabled and dims.describe() == "HSDP 2x8 + TP 2 + EP 4"


def test_single_process_has_no_meshes_and_needs_no_process_group():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=1)
    assert dims.build_mesh("cpu") is None
    assert dims.dp_mesh is None and dims.fsdp_mesh is None and dims.tp_mesh is None
    assert (dims.dp_rank, dims.dp_degree) == (0, 1)
    assert not (dims.dp_enabled or dims.fsdp_enabled or dims.tp_enabled)
    assert dims.describe() == "single process"


def test_build_mesh_refuses_a_world_that_does_not_match():
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
    with pytest.raises(RuntimeError, match="validated for world size 2 but the process group has no process group"):
        dims.build_mesh("cpu")


@pytest.mark.parametrize("tp, seq_len, sp, message", [
    (3, 96, True, "parallelism.tp=3 must divide the model's n_heads=8"),
    (8, 96, True, "parallelism.tp=8 must divide the model's n_kv_heads=4"),
    (4, 90, True, "training.seq_len=90 must be divisible by parallelism.tp=4"),
])
def test_model_shapes_must_split_over_tp(tp, seq_len, sp, message):
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=tp, world_size=tp)
    with pytest.raises(ValueError) as e:
        dims.validate_for_model(ARGS, seq_len, sequence_parallel=sp)
    assert message in str(e.value)


def test_sequence_length_only_matters_with_sequence_parallel():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=4, world_size=4)
    with pytest.raises(ValueError, match="training.seq_len=90 must be divisible by parallelism.tp=4"):
        dims.validate_for_model(ARGS, 90, sequence_parallel=True)
    # The same length without sequence parallelism, and a divisible one with it, are accepted (no error).
    assert dims.validate_for_model(ARGS, 90, sequence_parallel=False) is None
    assert dims.validate_for_model(ARGS, 96, sequence_parallel=True) is None


def test_tied_embeddings_are_refused_with_tp_but_fine_without():
    tied = Llama3ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="does not support tied embeddings"):
        ParallelDims(1, 1, 2, world_size=2).validate_for_model(tied, 64)
    assert ParallelDims(1, 2, 1, world_size=2).validate_for_model(tied, 64) is None
