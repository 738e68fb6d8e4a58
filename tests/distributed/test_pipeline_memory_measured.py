"""The per-rank pipeline estimate against the CPU profiler: two gloo ranks run a real pipeline step (the
trainer's stage cut, parallelize step and PipelineRunner), each rank's peak is measured and compared with the
estimate of its pipeline rank."""
from __future__ import annotations

import pytest
import torch
from _harness import run_ranks
from torch.profiler import ProfilerActivity, profile

from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig, ModelConfig, ParallelismConfig, TrainingConfig
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.pipeline import build_stage_modules
from torchtitan_lite.distributed.pipeline.runner import PipelineRunner
from torchtitan_lite.memory.estimate import estimate_ranks
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer


def _config(schedule: str, ac: str) -> Trainer.Config:
    return Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=4),
        training=TrainingConfig(seq_len=256, local_batch_size=4),
        precision=Precision.Config(param_dtype="float32"),
        parallelism=ParallelismConfig(pp=2, pipeline_schedule=schedule),
        activation_checkpoint=ActivationCheckpointConfig(mode=ac),
    )


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _measure(rank: int, world_size: int, schedule: str, ac: str) -> tuple[int, int]:
    """(measured peak bytes of the second step, the estimate's peak) on this rank."""
    torch.set_num_threads(1)
    cfg = _config(schedule, ac)
    run = resolve_run(cfg, world_size=world_size, device_type="cpu")
    run.parallel_dims.build_mesh("cpu")
    layout, spec = run.pipeline, run.model_spec
    with torch.device("meta"):
        model = spec.model_cls(run.model_args)
    stage_ids = layout.stage_ids(run.parallel_dims.pp_rank)
    precision = cfg.precision.build(device="cpu", resolved=run.precision)
    context = run.parallelize_context(mp_policy=precision.mp_policy())
    parts = []
    for part in build_stage_modules(model, spec.parallel_plan, layout, stage_ids):
        part = parallelize(part, spec.parallel_plan, context, label=spec.name)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights()
        parts.append(part.train())
    optimizer = cfg.optimizer.build(model_parts=parts)
    runner = PipelineRunner(layout, parts, stage_ids, group=run.parallel_dims.pp_mesh.get_group(),
                            device=torch.device("cpu"), loss_fn=cross_entropy_sum)
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    inputs = torch.randint(0, run.model_args.vocab_size, shape, generator=gen)
    labels = torch.randint(0, run.model_args.vocab_size, shape, generator=gen)

    def step() -> None:
        runner.step(inputs, labels, global_tokens=torch.tensor(float(labels.numel())))
        optimizer.step()
        optimizer.zero_grad()

    step()  # creates the optimizer state and the schedule's receive buffers
    # A first stage's inputs come from the batch: torch 2.11 lists them as placeholders without a buffer.
    recv = _nbytes(getattr(info, "buffer", None) for stage in runner.stages
                   for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()) for info in infos)
    resident = (_nbytes(t for part in parts for t in (*part.parameters(), *part.buffers()))
                + optimizer.state_nbytes() + recv)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    current = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return resident + peak, estimate_ranks(run)[run.parallel_dims.pp_rank].peak_allocated


@pytest.mark.parametrize(("schedule", "ac", "rel"), [
    ("1F1B", "full", 0.03),
    ("Interleaved1F1B", "full", 0.05),
    ("ZBVZeroBubble", "none", 0.05),
    ("DualPipeV", "none", 0.08),
])
def test_pipeline_rank_peaks_match_the_cpu_profiler(schedule, ac, rel):
    """Measured gaps (both ranks): 1F1B 0.0 / +1.2%, Interleaved1F1B -0.5 / +4.8% (the estimate adds a block's
    backward transient to the most micro-batches held, which a rank with two stages does not reach at the same
    moment), ZBVZeroBubble -0.7 / -2.6% (the gradients kept between the I and W passes are approximated),
    DualPipeV +6.8 / +0.9% (the overlapped forward is counted before its paired backward frees anything).
    Not covered: ZBVZeroBubble and DualPipeV with activation checkpointing, which the estimate puts 13-25% low
    (memory/pipeline_rank.py, _awaiting_weight_bytes)."""
    for rank, (measured, estimated) in enumerate(run_ranks(_measure, 2, schedule, ac)):
        assert estimated == pytest.approx(measured, rel=rel), (rank, measured, estimated)
