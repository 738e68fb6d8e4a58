"""Planning under pipeline parallelism: the micro-batches each rank holds at once, replayed from torch's own
schedules, and the per-rank memory estimate: the model's bytes split over the pipeline ranks exactly as the
stages are cut, activations of pipeline micro-batches (not of the local batch), the largest rank named."""
from __future__ import annotations

import pytest
import torch

from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig, ModelConfig, ParallelismConfig, TrainingConfig
from torchtitan_lite.distributed.pipeline import build_stage_modules, resolve_pipeline
from torchtitan_lite.distributed.pipeline.in_flight import max_in_flight, peak_held_bytes
from torchtitan_lite.memory.estimate import estimate_ranks, estimate_run_memory
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer


def _layout(schedule: str, *, pp: int, m: int, v: int = 0, n_layers: int = 24):
    return resolve_pipeline(pp=pp, schedule=schedule, stages_per_rank=v, microbatch_size=1, split_points=[],
                            layers_per_stage=0, n_layers=n_layers, local_batch_size=m, blocks="layers")


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m_per_rank", [1, 2])
def test_1f1b_rank_r_holds_p_minus_r_micro_batches(pp, m_per_rank):
    layout = _layout("1F1B", pp=pp, m=pp * m_per_rank)
    held = [max_in_flight(layout, r) for r in range(pp)]
    assert held == [({r: pp - r}, pp - r) for r in range(pp)]


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 2), (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16), (8, 4, 32)])
def test_interleaved_1f1b_holds_megatrons_warm_up_count(pp, v, m):
    layout = _layout("Interleaved1F1B", pp=pp, v=v, m=m, n_layers=pp * v * 2)
    for r in range(pp):
        assert max_in_flight(layout, r)[1] == min(v * m, (v - 1) * pp + 2 * (pp - 1 - r) + 1), r


@pytest.mark.parametrize(("schedule", "extra"), [("ZBVZeroBubble", 0), ("DualPipeV", 1)])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_v_schedules_hold_2p_micro_batches_on_every_rank(schedule, extra, pp, m):
    layout = _layout(schedule, pp=pp, m=m)
    for r in range(pp):
        per_stage, most = max_in_flight(layout, r)
        assert per_stage == {r: 2 * pp - r, 2 * pp - 1 - r: r + 1}
        assert most == 2 * pp + extra


def test_held_bytes_weigh_each_micro_batch_by_its_stage():
    # Rank 0 of ZBV at p 2, m 4: its first stage (0) holds up to 4, its second (3) up to 1, never both at
    # their maximum: the replay's largest weighted sum is smaller than the sum of the maxima.
    layout = _layout("ZBVZeroBubble", pp=2, m=4)
    assert max_in_flight(layout, 0) == ({0: 4, 3: 1}, 4)
    assert peak_held_bytes(layout, 0, {0: 1, 3: 0}) == 4
    assert peak_held_bytes(layout, 0, {0: 0, 3: 1}) == 1
    assert peak_held_bytes(layout, 0, {0: 10, 3: 1}) < 4 * 10 + 1


def _config(*, n_layers=6, batch=8, microbatch=1, schedule="1F1B", **parallelism) -> Trainer.Config:
    return Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=n_layers),
        training=TrainingConfig(seq_len=64, local_batch_size=batch),
        precision=Precision.Config(param_dtype="bfloat16"),
        parallelism=ParallelismConfig(pipeline_schedule=schedule, pipeline_microbatch_size=microbatch,
                                      **parallelism),
        activation_checkpoint=ActivationCheckpointConfig(mode="full"),
    )


def test_pipeline_ranks_hold_exactly_their_stages_parameters():
    """Without FSDP the estimate's per-rank bytes equal the stage modules build_stage_modules cuts."""
    run = resolve_run(_config(pp=2, schedule="Interleaved1F1B"), world_size=2, device_type="cpu")
    layout = run.pipeline
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    for est in estimate_ranks(run):
        parts = build_stage_modules(model, run.model_spec.parallel_plan, layout, layout.stage_ids(est.pp_rank))
        with torch.device("meta"):
            model = run.model_spec.model_cls(run.model_args)
        assert est.parameters == sum(p.numel() for part in parts for p in part.parameters()) * 4


def test_pipeline_ranks_split_the_sharded_model_between_them():
    """PP 2 x FSDP 2 holds, over its two pipeline ranks, exactly what FSDP 2 alone holds per rank."""
    whole = estimate_run_memory(resolve_run(_config(dp_shard=2), world_size=2, device_type="cpu"))
    ranks = estimate_ranks(resolve_run(_config(pp=2, dp_shard=2), world_size=4, device_type="cpu"))
    for name in ("parameters", "gradients", "optimizer states"):
        assert sum(r[name] for r in ranks) == whole[name], name


def test_in_flight_activations_are_of_pipeline_micro_batches_and_the_largest_rank_is_named():
    def ranks(batch: int, microbatch: int):
        run = resolve_run(_config(pp=2, dp_shard=2, batch=batch, microbatch=microbatch), world_size=4,
                          device_type="cpu")
        return run, estimate_ranks(run)

    _, eight = ranks(8, 1)
    _, sixteen = ranks(16, 1)
    run, doubled = ranks(16, 2)
    for a, b, c in zip(eight, sixteen, doubled, strict=True):
        # 1F1B holds at most p micro-batches whatever their number; their activations are linear in tokens.
        assert a["activations in flight"] == b["activations in flight"] > 0
        assert c["activations in flight"] == 2 * a["activations in flight"]
    largest = max(doubled, key=lambda e: e.peak_allocated)
    assert estimate_run_memory(run).pp_rank == largest.pp_rank


@pytest.mark.parametrize(("schedule", "most"), [("1F1B", [2, 1]), ("Interleaved1F1B", [5, 3]),
                                                ("ZBVZeroBubble", [4, 4]), ("DualPipeV", [5, 5])])
def test_every_schedule_is_sized_with_the_micro_batches_its_ranks_hold(schedule, most):
    run = resolve_run(_config(pp=2, dp_shard=2, n_layers=8, schedule=schedule), world_size=4, device_type="cpu")
    ranks = estimate_ranks(run)
    for est, n in zip(ranks, most, strict=True):
        term = next(t for t in est.terms if t.name == "activations in flight")
        assert f"at most {n} micro-batches held at once" in term.how
    assert estimate_run_memory(run).peak_allocated == max(e.peak_allocated for e in ranks)


def test_the_embedding_ranks_step_copies_its_replicated_gradient_as_without_a_pipeline():
    """TP without FSDP: the embedding's gradient is replicated and the optimizer's DTensor op copies it to the
    shard. A pipeline rank holding the embedding counts that copy in its step scratch, as the rank of a run
    without a pipeline does; the other ranks have no such gradient."""
    whole = estimate_run_memory(resolve_run(_config(tp=2), world_size=2, device_type="cpu"))
    first, last = estimate_ranks(resolve_run(_config(pp=2, tp=2), world_size=4, device_type="cpu"))
    run = resolve_run(_config(tp=2), world_size=2, device_type="cpu")
    embedding = run.model_args.vocab_size * run.model_args.dim // 2 * 4
    copy = " + shard copy of the replicated embedding gradient"
    for est, scratch in ((whole, embedding), (first, embedding), (last, 0)):
        term = next(t for t in est.terms if t.name == "optimizer step scratch")
        assert (term.nbytes, term.how.endswith(copy)) == (scratch, bool(scratch))


def test_a_run_without_a_pipeline_is_one_rank_holding_what_the_pipeline_ranks_split():
    """One path for every rank: without a pipeline, estimate_ranks gives one rank (no pp_rank), the one
    estimate_run_memory gives; under TP without FSDP the pipeline ranks hold between them exactly its
    parameters, states, gradients and step scratch."""
    run = resolve_run(_config(tp=2), world_size=2, device_type="cpu")
    (whole,) = estimate_ranks(run)
    assert whole.pp_rank is None and whole == estimate_run_memory(run)
    ranks = estimate_ranks(resolve_run(_config(pp=2, tp=2), world_size=4, device_type="cpu"))
    for name in ("parameters", "gradients", "optimizer states", "optimizer step scratch"):
        assert sum(r[name] for r in ranks) == whole[name] > 0, name
