"""scripts/pipeline_bubble.py: the schedules' theoretical idle shares, the measured share from timings, the
equal split and the report, without starting ranks (a measurement takes minutes on two cores)."""
from __future__ import annotations

import pytest

from torchtitan_lite.tools import pipeline_bubble as bubble


def test_theory_of_the_looped_schedules_is_the_published_formula():
    # 1F1B: p-1 idle slots of m+p-1 (4 ranks, 8 micro-batches: 3/11).
    assert bubble.theory_idle_share("1F1B", pp=4, n_microbatches=8, stages_per_rank=1) == pytest.approx(3 / 11)
    assert bubble.theory_idle_share("1F1B", pp=2, n_microbatches=8, stages_per_rank=1) == pytest.approx(1 / 9)
    # Interleaved: the same p-1 slots, v times shorter: (p-1) / (v m + p-1).
    assert bubble.theory_idle_share("Interleaved1F1B", pp=4, n_microbatches=8, stages_per_rank=2) == pytest.approx(3 / 19)
    assert bubble.theory_idle_share("ZBVZeroBubble", pp=4, n_microbatches=8, stages_per_rank=2) == 0.0


def test_dualpipev_theory_from_chunk_times():
    # F = 1, input backward 1, weight backward 1 (B = 2): bubble (p-1)(F&B + B - 3W) = 3 * (3 + 2 - 3) = 6;
    # compute 8 micro-batches x 2 chunks x (F + B) = 48 -> 6 / 54.
    chunks = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    share = bubble.theory_idle_share("DualPipeV", pp=4, n_microbatches=8, stages_per_rank=2, chunk_s=chunks)
    assert share == pytest.approx(6 / 54)
    assert bubble.theory_idle_share("DualPipeV", pp=4, n_microbatches=8, stages_per_rank=2) is None
    # A weight backward longer than F&B + B would make the formula negative: no bubble, not a negative one.
    heavy_w = {"forward": 0.1, "backward_input": 0.1, "backward_weight": 5.0}
    assert bubble.theory_idle_share("DualPipeV", pp=2, n_microbatches=4, stages_per_rank=2, chunk_s=heavy_w) == 0.0
    with pytest.raises(ValueError, match="unknown schedule 'GPipe'"):
        bubble.theory_idle_share("GPipe", pp=2, n_microbatches=4, stages_per_rank=1)


def test_idle_share_and_chunk_means_from_rank_timings():
    assert bubble.idle_share(step_s=2.0, compute_s=1.5) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="step time must be positive"):
        bubble.idle_share(step_s=0.0, compute_s=0.0)
    ranks = [bubble.RankResult(2, "ZBVZeroBubble", r, (r, 3 - r), step_s=2.0, compute_s=1.0 + r, compute_cpu_s=1.0,
                               kind_s={"forward": 0.4 + r, "backward_input": 0.6}, kind_count={"forward": 4, "backward_input": 4})
             for r in range(2)]
    assert bubble.chunk_means(ranks) == pytest.approx({"forward": 1.8 / 8, "backward_input": 1.2 / 8})
    settings = bubble.Settings(steps=2)
    row, = bubble.summarize(ranks, settings)
    assert (row.pp, row.schedule, row.stages_per_rank, row.n_microbatches) == (2, "ZBVZeroBubble", 2, 8)
    assert row.idle == pytest.approx([0.5, 0.0]) and row.step_ms == pytest.approx(1000.0) and row.theory == 0.0
    assert row.cpu_share == pytest.approx(2.0 / 3.0)
    line = bubble.markdown([row])[-1]
    assert line == "| 2 | ZBVZeroBubble | 2 | 8 | 1000 | 50.0%, 0.0% | 25.0% | 0.0% | 225.0 / - / 150.0 / - | 0.67 |"


def test_stages_are_equal_and_bad_sizes_are_refused_before_any_rank_starts():
    assert bubble.equal_split_points(8, 4, "layers") == ["layers.2", "layers.4", "layers.6"]
    layout = bubble.layout_for("DualPipeV", 4, bubble.Settings())
    assert [len(s.blocks) for s in layout.stages] == [1] * 8 and layout.stage_ids(1) == (1, 6)
    with pytest.raises(SystemExit):
        bubble.parse_args(["--pp", "4", "--n-layers", "6"])  # 6 blocks do not make 4 or 8 equal stages
    with pytest.raises(ValueError, match="6 blocks do not split into 4 equal stages: use --n-layers a multiple of 4"):
        bubble.equal_split_points(6, 4, "layers")


def test_two_gloo_ranks_time_every_chunk_inside_the_step():
    """A real run, tiny: the clock sees each micro-batch's chunks on the rank the layout puts them on, and all of
    them fall inside the step (so the idle share is never negative). About 3 s after the imports."""
    import models  # noqa: F401  (registers llama3, which the ranks build)

    settings = bubble.Settings(n_layers=4, vocab_size=64, seq_len=16, microbatch_size=1, n_microbatches=4, warmup=1,
                               steps=1)
    results = bubble.run_pipeline(2, ["1F1B", "ZBVZeroBubble"], settings, timeout_s=120)
    assert [(r.schedule, r.rank, r.stage_ids) for r in results] == [
        ("1F1B", 0, (0,)), ("1F1B", 1, (1,)), ("ZBVZeroBubble", 0, (0, 3)), ("ZBVZeroBubble", 1, (1, 2))]
    counts = [r.kind_count for r in results]
    assert counts[0] == {"forward": 4, "backward": 4}
    assert counts[1] == {"forward": 4, "backward": 4, "loss": 4}  # the last stage computes the loss
    # ZBV: two stages per rank, the backward split into input and weight parts; the V ends on rank 0.
    assert counts[2] == {"forward": 8, "backward_input": 8, "backward_weight": 8, "loss": 4}
    assert counts[3] == {"forward": 8, "backward_input": 8, "backward_weight": 8}
    for r in results:
        assert 0 < r.compute_s <= r.step_s and 0 <= bubble.idle_share(r.step_s, r.compute_s) < 1


def test_cuda_rows_have_no_cpu_share():
    # On CUDA compute is GPU time from events, so thread CPU time says nothing about it.
    ranks = [bubble.RankResult(2, "1F1B", r, (r,), step_s=1.0, compute_s=0.9, compute_cpu_s=0.0,
                               kind_s={"forward": 0.3, "backward": 0.6}, kind_count={"forward": 8, "backward": 8},
                               gpu="NVIDIA H100 80GB HBM3") for r in range(2)]
    row, = bubble.summarize(ranks, bubble.Settings(steps=1, device="cuda"))
    assert row.cpu_share is None and bubble.markdown([row])[-1].endswith("| 37.5 / 75.0 / - / - | - |")
    assert bubble.environment([2], ranks, "cmd", (1.0, 2.0))[0].startswith("- GPUs: NVIDIA H100 80GB HBM3, one per rank")
