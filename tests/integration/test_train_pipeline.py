"""Pipeline parallelism through run_train.sh on CPU (gloo): from one seed checkpoint (a pipeline stage draws
its initial weights at another RNG position than one process does), every schedule trains as one process.

The pipeline ranks read the same data as one process (pp is not a data-parallel degree) and the loss of each
micro-batch is normalised by the step's global token count, so with float32 only the order of sums differs:
the losses agree to ``FP32_RTOL``. Layouts with data parallelism (FSDP 2) are held against FSDP 2 without a
pipeline, which reads the same documents. The runs share one seed checkpoint and one 1-process reference
(module-scoped); a short warmup and a constant learning rate make a reference's first steps those of a
shorter run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli import read_checkpoint, read_scalars, run_cli

STEPS = 20
COMMON = ["--training.seq_len", "32", "--training.local_batch_size", "4",
          "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant", "--validation.enable", "false",
          "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
VALIDATION = ["--validation.enable", "true", "--validation.freq", "10", "--validation.steps", "2"]
FP32_RTOL = 1e-5
"""float32, summation order only (micro-batch losses and gradients summed one by one instead of in one batch):
measured at most 3.7e-6 relative over the 20 steps of 1F1B on the global window order (4.0e-7 on the earlier
document order), 1.2e-7 for TP 2 x PP 2."""
VAL_RTOL = 1e-4
"""The validation loss at step 20, after 20 updates whose summation-order differences the steps amplify: measured
2.3e-5 relative under 1F1B and ZBVZeroBubble on the global window order. A pipeline that drops or doubles a
micro-batch moves it by percents."""
GRAD_NORM_RTOL = 5e-4
"""The gradient norm sums the squares of every gradient, whose last bits the order of sums moves, and the steps
amplify those bits: on the global window order, 1F1B's norms agree to 4e-7 over steps 1-13 and then drift to
1.3e-4 at step 17 (measured; the losses stay within 4e-6). A gradient counted twice or missed moves the norm by
tens of percent."""
MOMENT_RTOL = 1e-2
"""The AdamW moments after the 20 steps (running means of the gradients and of their squares), per tensor
|difference| / |one process's| (2-norms): the order of sums again, compounded over the steps (measured 3.7e-3 at
most under 1F1B and ZBVZeroBubble on the global window order, 3.1e-5 on the earlier per-rank document order, whose
batches moved the weights less); a gradient counted twice or missed moves its moments by 0.5 to 3."""
FP16_RTOL = 1e-5
"""float16 against float16 on the same micro-batches (the same matmul shapes): only the order of the float32
sums differs. Measured: bit-identical losses and scales over the 5 steps (3 skipped)."""
FP8_RTOL = 1e-4
"""float8 against float8 on the same micro-batches: the same casts, only the order of sums differs; a last-bit
change in a weight can still move a tensor's amax and with it the float8 rounding of the whole tensor, so the
margin is wider than float32's. Measured: bit-identical losses over 5 steps (3 in the test)."""


def train(folder: Path, args: list[str], nproc: int = 1, config: str = "llama3_debug") -> dict[str, dict[int, float]]:
    # One thread per process: the ranks share the cores, and spinning OpenMP threads would stall each other.
    # One process runs train.py itself, without run_train.sh's preflight check and torchrun start-up (the seed
    # fixture runs the documented run_train.sh command).
    result = run_cli(["--config", config, *COMMON, *args, "--job.dump_folder", str(folder)], NPROC=str(nproc),
                     OMP_NUM_THREADS="1", launcher="run_train.sh" if nproc > 1 else "train.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    scalars = read_scalars(folder / "tb")
    scalars["log"] = result.stdout + result.stderr  # type: ignore[assignment]
    scalars["folder"] = folder  # type: ignore[assignment]
    return scalars


def adam_moments(run: dict, step: int) -> dict[str, torch.Tensor]:
    """The AdamW moments (first and second) of ``run``'s checkpoint at ``step``, by parameter."""
    state = read_checkpoint(run["folder"] / "checkpoint" / f"step-{step}")
    return {k: v for k, v in state.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}  # type: ignore[misc]


def max_moment_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Per tensor, |difference| / |reference| (2-norms), the largest."""
    assert set(got) == set(want) and got
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("seed")
    result = run_cli(["--config", "llama3_debug", *COMMON, "--checkpoint.create_seed_checkpoint", "true",
                      "--job.dump_folder", str(folder)], OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    return ["--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-0")]


@pytest.fixture(scope="module")
def reference(seed, tmp_path_factory) -> dict[str, dict[int, float]]:
    """One process, float32, 20 steps, validated at steps 0, 10 and 20."""
    return train(tmp_path_factory.mktemp("one"), [*seed, *VALIDATION, "--training.steps", str(STEPS)])


def max_rel_diff(got: dict[int, float], want: dict[int, float]) -> float:
    assert set(got) <= set(want) and got, (got, want)
    return max(abs(got[step] - want[step]) / abs(want[step]) for step in got)


def test_1f1b_trains_and_validates_as_one_process_and_rank_0_logs_the_last_stages_loss(seed, reference, tmp_path):
    # Under 1F1B rank 0 holds no loss: it logs, checks for finiteness and judges spikes by the last stage's loss,
    # shared over the pipeline group. A rank judging another loss would skip other steps than rank 1.
    spikes = ["--training.spike_policy.enable", "true", "--training.spike_policy.max_rollbacks", "0",
              "--training.spike_policy.min_history", "3"]
    run = train(tmp_path, [*seed, *VALIDATION, *spikes, "--training.steps", str(STEPS), "--parallelism.pp", "2"], nproc=2)
    assert "PP 2 (1F1B, 2 stages, 1 per rank, 4 micro-batches of 1)" in run["log"]
    assert set(run["train/loss"]) == set(range(1, STEPS + 1))
    assert max_rel_diff(run["train/loss"], reference["train/loss"]) <= FP32_RTOL
    assert max_rel_diff(run["train/grad_norm"], reference["train/grad_norm"]) <= GRAD_NORM_RTOL
    # The gradients themselves, through the AdamW moments saved at the last step (their running means over the
    # steps): the losses and the total norm cannot show one parameter's gradient scaled.
    worst = max_moment_rel_diff(adam_moments(run, STEPS), adam_moments(reference, STEPS))
    assert worst <= MOMENT_RTOL
    # Validation runs the eval schedule; only the last stage's rank sees the loss, and it is shared.
    assert set(run["val/loss"]) == {0, 10, 20}
    assert max_rel_diff(run["val/loss"], reference["val/loss"]) <= VAL_RTOL


def test_zbv_trains_and_validates_as_one_process(seed, reference, tmp_path):
    """Two stages per rank in V placement (rank 0 holds the first and the last stage); validation runs the V
    schedule forward only."""
    run = train(tmp_path, [*seed, *VALIDATION, "--training.steps", str(STEPS), "--parallelism.pp", "2",
                           "--parallelism.pipeline_schedule", "ZBVZeroBubble"], nproc=2)
    assert "PP 2 (ZBVZeroBubble, 4 stages, 2 per rank, 4 micro-batches of 1)" in run["log"]
    assert set(run["train/loss"]) == set(range(1, STEPS + 1))
    assert max_rel_diff(run["train/loss"], reference["train/loss"]) <= FP32_RTOL
    worst = max_moment_rel_diff(adam_moments(run, STEPS), adam_moments(reference, STEPS))
    assert worst <= MOMENT_RTOL
    assert set(run["val/loss"]) == {0, 10, 20}
    assert max_rel_diff(run["val/loss"], reference["val/loss"]) <= VAL_RTOL


@pytest.mark.slow
def test_interleaved_1f1b_trains_as_one_process(seed, reference, tmp_path):
    """Two stages per rank in loop placement. (DualPipeV, V placement as ZBVZeroBubble above, trains as one
    process in tests/distributed/test_moe_pipeline.py, through the same PipelineRunner.)"""
    run = train(tmp_path, [*seed, "--training.steps", str(STEPS), "--parallelism.pp", "2",
                           "--parallelism.pipeline_schedule", "Interleaved1F1B"], nproc=2)
    assert "PP 2 (Interleaved1F1B, 4 stages, 2 per rank, 4 micro-batches of 1)" in run["log"]
    assert set(run["train/loss"]) == set(range(1, STEPS + 1))
    assert max_rel_diff(run["train/loss"], reference["train/loss"]) <= FP32_RTOL


@pytest.mark.slow
def test_tp2_x_pp2_on_4_ranks_trains_as_one_process(seed, reference, tmp_path):
    """The default suite's cheap counterpart: tests/distributed/test_llama_pipeline.py::
    test_tp2_x_pp2_on_4_ranks_trains_as_one_process (the trainer's build and step, in process)."""
    run = train(tmp_path, [*seed, "--training.steps", "3", "--parallelism.pp", "2", "--parallelism.tp", "2"], nproc=4)
    assert set(run["train/loss"]) == {1, 2, 3}
    assert max_rel_diff(run["train/loss"], reference["train/loss"]) <= FP32_RTOL


def test_fp16_loss_scaling_skips_and_scales_as_one_process(seed, tmp_path):
    """The schedule runs backward itself: the loss scale enters through its loss function. Started at 2^22 the
    scale overflows float16 gradients; the overflowing steps are skipped and the scale backs off as in one
    process. Whether a gradient overflows depends on how many tokens one backward sums, so the process
    accumulates the pipeline's micro-batches (4 of 1 sample) instead of running its batch of 4 at once."""
    fp16 = [*seed, "--precision.init_scale", str(2.0**22), "--training.steps", "5"]
    one = train(tmp_path / "one", [*fp16, "--training.local_batch_size", "1", "--training.global_batch_size", "4"],
                config="llama3_debug_fp16")
    pp = train(tmp_path / "pp", [*fp16, "--parallelism.pp", "2"], nproc=2, config="llama3_debug_fp16")
    assert 0 < one["train/skipped_steps"][5] < 5
    assert pp["train/skipped_steps"] == one["train/skipped_steps"]
    assert pp["train/loss_scale"] == one["train/loss_scale"]
    assert max_rel_diff(pp["train/loss"], one["train/loss"]) <= FP16_RTOL


@pytest.mark.slow
def test_pp2_x_fsdp2_float8_with_the_fp8_all_gather_trains_as_fsdp2(seed, tmp_path):
    """float8 tensorwise with FP8 all-gather and precomputed scales, per stage. The dynamic scales follow the
    activations of each forward, so the pipeline's micro-batches (2 samples) are FSDP 2's accumulation
    micro-batches (2 samples, 2 per step): the same casts, the same documents per rank. The default suite's
    cheap counterpart, with the all-gathers and the precompute checked on the wire: tests/distributed/
    test_llama_pipeline.py::test_pp2_x_fsdp2_float8_with_the_fp8_all_gather_and_precomputed_scales_trains_as_one_process."""
    fp8 = [*seed, "--model_converters.converters.0.enable_fsdp_float8_all_gather",
           "true", "--model_converters.converters.0.precompute_float8_dynamic_scale_for_fsdp", "true",
           "--training.steps", "3", "--parallelism.dp_shard", "2"]
    fsdp = train(tmp_path / "fsdp", [*fp8, "--training.local_batch_size", "2", "--training.global_batch_size", "8"],
                 nproc=2, config="llama3_debug_fp8")
    pp = train(tmp_path / "pp", [*fp8, "--parallelism.pp", "2", "--parallelism.pipeline_microbatch_size", "2"], nproc=4,
               config="llama3_debug_fp8")
    assert "parallelized llama3: PP 2 + FSDP 2" in pp["log"]
    assert max_rel_diff(pp["train/loss"], fsdp["train/loss"]) <= FP8_RTOL


@pytest.mark.slow
def test_pp2_with_compile_and_full_ac_trains_as_one_process(seed, reference, tmp_path):
    """Compiled, fully checkpointed stages against the eager one-process reference: in float32 inductor's
    fusions, like the order of sums, move only last bits (measured 6.1e-8 relative over the 3 steps, within
    FP32_RTOL). The default suite's cheap counterpart (aot_eager: dynamo and AOT autograd through the checkpoint
    wrapper, no code generation; inductor under PP is tested only here): tests/distributed/test_llama_pipeline.py::
    test_pp2_with_compile_and_full_ac_trains_as_one_process."""
    pp = train(tmp_path, [*seed, "--compile.enable", "true", "--activation_checkpoint.mode", "full",
                          "--training.steps", "3", "--parallelism.pp", "2"], nproc=2)
    assert set(pp["train/loss"]) == {1, 2, 3}
    assert max_rel_diff(pp["train/loss"], reference["train/loss"]) <= FP32_RTOL
