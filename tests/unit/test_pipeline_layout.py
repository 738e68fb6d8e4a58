"""The pipeline layout: the automatic split rule, explicit splits, stage placement and every refusal."""
from __future__ import annotations

import pytest

from torchtitan_lite.distributed.pipeline import resolve_pipeline


def layout(*, pp=2, schedule="1F1B", stages_per_rank=0, microbatch_size=1, split_points=(), layers_per_stage=0,
           n_layers=6, local_batch_size=8, tied_embeddings=False, compiled_blocks=False):
    return resolve_pipeline(pp=pp, schedule=schedule, stages_per_rank=stages_per_rank, microbatch_size=microbatch_size,
                            split_points=list(split_points), layers_per_stage=layers_per_stage, n_layers=n_layers,
                            local_batch_size=local_batch_size, blocks="layers", tied_embeddings=tied_embeddings,
                            compiled_blocks=compiled_blocks)


def sizes(result) -> list[int]:
    return [len(stage.blocks) for stage in result.stages]


def test_pp_1_has_no_layout():
    assert layout(pp=1) is None


def test_405b_on_8_stages_lightens_the_first_and_last_stage_by_one_block():
    # 126 blocks + embedding + head = 128 units, 16 per stage: the end stages carry one unit of their own.
    result = layout(pp=8, n_layers=126)
    assert sizes(result) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert result.stages[0].blocks[0] == "0" and result.stages[-1].blocks[-1] == "125"
    assert [s.first for s in result.stages] == [True] + [False] * 7
    assert [s.last for s in result.stages] == [False] * 7 + [True]


@pytest.mark.parametrize(("n_layers", "n_stages", "expected"), [
    (6, 2, [3, 3]),           # 8 units, 4 each
    (6, 4, [1, 2, 2, 1]),     # 8 units, 2 each
    (7, 2, [3, 4]),           # 9 units: the extra one goes to the last stage when there is no middle one
    (9, 4, [1, 3, 3, 2]),     # 11 units: 2 each, the 3 extra to the two middle stages, then the last
    (4, 4, [1, 1, 1, 1]),     # the charge would empty the end stages: an even split of the blocks instead
    (2, 2, [1, 1]),
])
def test_automatic_split_of_small_models(n_layers, n_stages, expected):
    schedule = "1F1B" if n_stages == 2 else "Interleaved1F1B"
    result = layout(n_layers=n_layers, schedule=schedule)
    assert sizes(result) == expected
    assert [b for s in result.stages for b in s.blocks] == [str(i) for i in range(n_layers)]


def test_explicit_split_points_name_the_first_block_of_each_later_stage():
    result = layout(schedule="Interleaved1F1B", split_points=["layers.1", "layers.3", "layers.5"])
    assert [s.blocks for s in result.stages] == [("0",), ("1", "2"), ("3", "4"), ("5",)]
    assert result.stages[1].describe() == "stage 1: blocks 1-2"
    assert result.stages[0].describe() == "stage 0: embedding + block 0"
    assert result.stages[3].describe() == "stage 3: block 5 + head"


def test_layers_per_stage_sets_the_stage_count():
    # (6 blocks + embedding + head) / 2 = 4 stages: 2 per rank on pp 2.
    result = layout(schedule="Interleaved1F1B", layers_per_stage=2)
    assert result.stages_per_rank == 2 and sizes(result) == [1, 2, 2, 1]
    assert layout(layers_per_stage=4).n_stages == 2


def test_loop_and_v_placement():
    loop = layout(pp=2, schedule="Interleaved1F1B", stages_per_rank=3, n_layers=12)
    assert [loop.stage_ids(r) for r in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert loop.rank_of_stage(5) == 1
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        v = layout(pp=4, schedule=schedule, n_layers=12)
        assert [v.stage_ids(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
        assert v.rank_of_stage(7) == 0 and v.rank_of_stage(4) == 3
    one = layout(pp=4, n_layers=12, local_batch_size=4)
    assert [one.stage_ids(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_compiled_blocks_run_under_the_1f1b_schedules():
    assert layout(compiled_blocks=True).n_stages == 2
    assert layout(schedule="Interleaved1F1B", compiled_blocks=True).n_stages == 4


def test_microbatches_and_describe():
    result = layout(schedule="Interleaved1F1B", microbatch_size=2, local_batch_size=8)
    assert result.n_microbatches == 4
    assert result.describe() == "PP 2 (Interleaved1F1B, 4 stages, 2 per rank, 4 micro-batches of 2)"
    assert layout(schedule="DualPipeV", local_batch_size=4).describe() == (
        "PP 2 (DualPipeV, 4 stages, 2 per rank, 4 micro-batches of 1)")


def test_zbv_takes_any_microbatch_count():
    # torch builds the ZBV order for max(2 pp - 1, n) micro-batches and keeps the first n.
    assert layout(schedule="ZBVZeroBubble", local_batch_size=5).n_microbatches == 5
    assert layout(schedule="ZBVZeroBubble", local_batch_size=1).n_microbatches == 1


def test_interleaved_takes_the_microbatch_counts_the_readme_states():
    """README (Pipeline parallelism): 'at pp 2: 1, 2, 3 and every even number; at pp 4: 1 to 8, 10, 12, 15, 16, 20'
    -- torch's rule (max(1, n // pp) rounds of equal size), not 'a multiple of pp, or fewer than pp'."""
    def takes(n: int, pp: int) -> bool:
        try:
            layout(pp=pp, schedule="Interleaved1F1B", local_batch_size=n, n_layers=16)
        except ValueError:
            return False
        return True

    assert [n for n in range(1, 15) if takes(n, 2)] == [1, 2, 3, 4, 6, 8, 10, 12, 14]
    assert [n for n in range(1, 21) if takes(n, 4)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16, 20]


REFUSALS = [
    (dict(schedule="1F1B", stages_per_rank=2),
     "parallelism.pipeline_schedule=1F1B runs exactly 1 stage(s) per rank, got 2; use Interleaved1F1B for several "
     "stages per rank"),
    (dict(schedule="ZBVZeroBubble", stages_per_rank=3, n_layers=12),
     "parallelism.pipeline_schedule=ZBVZeroBubble runs exactly 2 stage(s) per rank, got 3; set "
     "parallelism.pipeline_stages_per_rank=2 (or 0)"),
    (dict(schedule="DualPipeV", stages_per_rank=3, n_layers=12),
     "parallelism.pipeline_schedule=DualPipeV runs exactly 2 stage(s) per rank, got 3; set "
     "parallelism.pipeline_stages_per_rank=2 (or 0)"),
    (dict(schedule="Interleaved1F1B", stages_per_rank=1),
     "parallelism.pipeline_schedule=Interleaved1F1B loops over several stages per rank, got 1; use "
     "pipeline_stages_per_rank >= 2, or the 1F1B schedule for one stage per rank"),
    (dict(pp=4, local_batch_size=3, n_layers=8),
     "the 1F1B schedule needs at least as many micro-batches as stages (4): change training.local_batch_size or "
     "parallelism.pipeline_microbatch_size=1 (3 micro-batches now)"),
    (dict(schedule="DualPipeV", local_batch_size=3),
     "the DualPipeV schedule needs at least as many micro-batches as stages (4): change training.local_batch_size "
     "or parallelism.pipeline_microbatch_size=1 (3 micro-batches now)"),
    (dict(schedule="Interleaved1F1B", local_batch_size=5),
     "the Interleaved1F1B schedule cuts its micro-batches into n // pp = 5 // 2 = 2 rounds of equal size, and 5 is "
     "not a multiple of 2: it takes any count below 4 (2 pp) and, from 4 on, a multiple of n // pp, such as 4 or 6: "
     "change training.local_batch_size or parallelism.pipeline_microbatch_size=1 (5 micro-batches now)"),
    (dict(schedule="Interleaved1F1B", pp=4, local_batch_size=13, n_layers=16),
     "the Interleaved1F1B schedule cuts its micro-batches into n // pp = 13 // 4 = 3 rounds of equal size, and 13 is "
     "not a multiple of 3: it takes any count below 8 (2 pp) and, from 8 on, a multiple of n // pp, such as 12 or 15: "
     "change training.local_batch_size or parallelism.pipeline_microbatch_size=1 (13 micro-batches now)"),
    (dict(local_batch_size=6, microbatch_size=4),
     "training.local_batch_size=6 must be a multiple of parallelism.pipeline_microbatch_size=4: the pipeline cuts "
     "each local batch into micro-batches of that size"),
    (dict(split_points=["layers.3", "layers.4"]),
     "parallelism.pipeline_split_points names 2 boundaries, but 2 stages need 1 (the first block of every stage but "
     "the first, e.g. 'layers.4')"),
    (dict(split_points=["layers.6"]),
     "parallelism.pipeline_split_points entry 'layers.6' is not a block boundary: use 'layers.<i>' with 0 < i < 6 "
     "(the first block of a stage)"),
    (dict(split_points=["blocks.2"]),
     "parallelism.pipeline_split_points entry 'blocks.2' is not a block boundary: use 'layers.<i>' with 0 < i < 6 "
     "(the first block of a stage)"),
    (dict(split_points=["layers.0"]),
     "parallelism.pipeline_split_points entry 'layers.0' is not a block boundary: use 'layers.<i>' with 0 < i < 6 "
     "(the first block of a stage)"),
    (dict(schedule="Interleaved1F1B", split_points=["layers.3", "layers.2", "layers.4"]),
     "parallelism.pipeline_split_points ['layers.3', 'layers.2', 'layers.4'] must name distinct blocks in "
     "increasing order"),
    (dict(tied_embeddings=True),
     "parallelism.pp=2 cannot split a model whose embedding and output head share one matrix (tie_word_embeddings): "
     "they live on the first and the last stage. Use a flavor with untied embeddings or parallelism.pp=1"),
    (dict(pp=1, split_points=["layers.3"]),
     "parallelism.pipeline_split_points / pipeline_layers_per_stage split the model into pipeline stages, but "
     "parallelism.pp=1: set --parallelism.pp to the number of pipeline ranks, or drop them"),
    (dict(pp=1, layers_per_stage=3),
     "parallelism.pipeline_split_points / pipeline_layers_per_stage split the model into pipeline stages, but "
     "parallelism.pp=1: set --parallelism.pp to the number of pipeline ranks, or drop them"),
    (dict(pp=4, schedule="Interleaved1F1B", n_layers=6),
     "8 pipeline stages (pp=4 x 2 per rank) need at least one block each, but the model has 6; lower "
     "parallelism.pp or the stages per rank"),
    (dict(layers_per_stage=3),
     "parallelism.pipeline_layers_per_stage=3 makes 3 stages ((6 blocks + embedding + head) / 3, rounded up), not a "
     "multiple of parallelism.pp=2; choose a value that gives a multiple of 2 stages"),
    (dict(schedule="Interleaved1F1B", layers_per_stage=2, stages_per_rank=2, n_layers=10),
     "parallelism.pipeline_layers_per_stage=2 makes 3 stages per rank but parallelism.pipeline_stages_per_rank=2; "
     "set one of them"),
    *[(dict(schedule=schedule, compiled_blocks=True),
       f"parallelism.pipeline_schedule={schedule} splits each backward into an input-gradient and a weight-gradient "
       "pass over one retained graph, which compiled blocks do not allow (their backward donates its buffers and "
       "runs once): use the 1F1B or Interleaved1F1B schedule, or compile only the loss (--compile.components loss)")
      for schedule in ("ZBVZeroBubble", "DualPipeV")],
    (dict(schedule="GPipe"), "parallelism.pipeline_schedule='GPipe' is not one of 1F1B, Interleaved1F1B, "
     "ZBVZeroBubble, DualPipeV"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSALS, ids=range(len(REFUSALS)))
def test_refusals_name_the_problem_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as raised:
        layout(**overrides)
    assert str(raised.value) == message


@pytest.mark.parametrize("option, name", [
    (dict(schedule="Interleaved1F1B"), "parallelism.pipeline_schedule=Interleaved1F1B"),
    (dict(stages_per_rank=2), "parallelism.pipeline_stages_per_rank=2"),
    (dict(microbatch_size=2), "parallelism.pipeline_microbatch_size=2"),
])
def test_pipeline_options_without_a_pipeline_are_refused_not_ignored(option, name):
    with pytest.raises(ValueError) as error:
        layout(pp=1, **option)
    assert str(error.value) == (f"{name} configure(s) a pipeline, but parallelism.pp=1 runs none, so it would be "
                                f"ignored: set --parallelism.pp to the number of pipeline ranks, or drop it")


def test_the_pp_1_defaults_are_the_configs_defaults():
    from torchtitan_lite.config.sections import ParallelismConfig
    from torchtitan_lite.distributed.pipeline.layout import PP1_DEFAULTS

    par = ParallelismConfig()
    assert PP1_DEFAULTS == {"schedule": par.pipeline_schedule, "stages_per_rank": par.pipeline_stages_per_rank,
                            "microbatch_size": par.pipeline_microbatch_size}
