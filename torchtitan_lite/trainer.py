"""The native training loop: build every component from ``Trainer.Config``, then train.

What is built from config sections alone (seeds, validator, FP8 statistics, the resumed-layout report, the
saved config) is in ``trainer_setup``; what the host does with the steps it reads (the non-finite stop, the
loss statistics, what a log step reads) is in ``step_reader``."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import torchtitan_lite.components.quantization  # noqa: F401  (registers the built-in converter kinds)
from torchtitan_lite.aux_loss_weight import set_aux_loss_weight
from torchtitan_lite.batch_sums import global_target_tokens, sum_over
from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.seed_warning import seed_over_later_run
from torchtitan_lite.components.data import TextDataLoader
from torchtitan_lite.components.data.readiness import require_data
from torchtitan_lite.components.data.sequence_layout import SequenceLayout, check_document_starts
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.components.lr_scheduler import LRSchedulersContainer
from torchtitan_lite.components.metrics import MetricsProcessor
from torchtitan_lite.components.optimizer import OptimizersContainer
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.profiler import Profiler
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.components.validate import Validator
from torchtitan_lite.config import Configurable, config_to_toml
from torchtitan_lite.config.sections import (
    ActivationCheckpointConfig,
    CompileConfig,
    DebugConfig,
    JobConfig,
    ModelConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan_lite.cpu_vector_codegen import use_correct_cpu_vector_width
from torchtitan_lite.distributed.compile import CompileStats, compile_stats, first_step_compile_label, maybe_compile_loss
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.step_runner import share_loss
from torchtitan_lite.distributed.tensor_parallel import local_loss, loss_parallel_context
from torchtitan_lite.loss_health import LossHealth
from torchtitan_lite.mesh import process_groups as dist_utils
from torchtitan_lite.model_parts import build_model_parts
from torchtitan_lite.nonfinite import NonFiniteLossError as NonFiniteLossError  # re-exported: train.py catches it here
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.shutdown import PreemptionWatcher
from torchtitan_lite.spike_guard import SpikeGuard, Verdict
from torchtitan_lite.spike_response import SpikeResponse
from torchtitan_lite.step_reader import data_scalars, extra_metrics, model_stats, settle
from torchtitan_lite.step_values import PendingSteps, StepValues
from torchtitan_lite.train_state import TrainState, check_steps_ahead
from torchtitan_lite.trainer_setup import (
    build_fp8_stats,
    build_validator,
    data_order_seed,
    describe_converters,
    report_resumed_layout,
    save_resolved_config,
    set_determinism,
)

logger = logging.getLogger("torchtitan_lite")


class Trainer(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        job: JobConfig = field(default_factory=JobConfig)
        """Run identity and output folder."""
        model: ModelConfig = field(default_factory=ModelConfig)
        """Model family and size."""
        tokenizer: Tokenizer.Config = field(default_factory=Tokenizer.Config)
        """SentencePiece model or Hugging Face tokenizer.json (or a model folder holding one)."""
        training: TrainingConfig = field(default_factory=TrainingConfig)
        """Steps, batch and sequence sizes, clipping, seed."""
        precision: Precision.Config = field(default_factory=Precision.Config)
        """Parameter / reduction dtypes and FP16 loss scaling."""
        parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
        """Data / tensor parallel degrees."""
        activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
        """Activation recomputation."""
        compile: CompileConfig = field(default_factory=CompileConfig)
        """torch.compile."""
        model_converters: ModelConvertersContainer.Config = field(default_factory=ModelConvertersContainer.Config)
        """Module swaps applied before parallelisation (FP8 training)."""
        optimizer: OptimizersContainer.Config = field(default_factory=OptimizersContainer.Config)
        """Optimizer."""
        lr_scheduler: LRSchedulersContainer.Config = field(default_factory=LRSchedulersContainer.Config)
        """Learning-rate schedule."""
        data: TextDataLoader.Config = field(default_factory=TextDataLoader.Config)
        """Training and validation text."""
        validation: Validator.Config = field(default_factory=Validator.Config)
        """Periodic validation loss."""
        checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)
        """Distributed checkpoints and exports."""
        metrics: MetricsProcessor.Config = field(default_factory=MetricsProcessor.Config)
        """Console and TensorBoard metrics."""
        profiling: Profiler.Config = field(default_factory=Profiler.Config)
        """torch.profiler traces."""
        debug: DebugConfig = field(default_factory=DebugConfig)
        """Determinism and anomaly detection."""

        def __post_init__(self) -> None:
            spikes = self.training.spike_policy
            if spikes.enable and spikes.max_rollbacks > 0 and not self.checkpoint.enable:
                raise ValueError(
                    f"training.spike_policy.max_rollbacks={spikes.max_rollbacks} rolls back to the last good "
                    f"checkpoint, but checkpoint.enable=false: set --checkpoint.enable true (with a "
                    f"checkpoint.interval that leaves checkpoints before a spike), or --training.spike_policy."
                    f"max_rollbacks 0 to only skip spiking steps (the run then stops past the skip limits)")

    config: Trainer.Config

    def __init__(self, config: Trainer.Config) -> None:
        self.config = config
        self._resolve()
        self._build_model_and_optimizers()
        self._build_loop_components()

    # ----------------------------------------------------------------------------------------------
    # Construction, in this order: each step uses what the ones before it built

    def _resolve(self) -> None:
        """Refuse what cannot run, resolve the run, then join the process group and seed the ranks."""
        cfg = self.config
        # A missing tokenizer or unreachable dataset stops the run here, before any process group exists.
        require_data(cfg.data, cfg.tokenizer, validation=cfg.validation.enable)
        self.tokenizer = cfg.tokenizer.build()
        # Every derived fact (degrees, model args, precision, micro-batches, converters) is resolved and
        # checked here, before any process-group work.
        self.run = resolve_run(cfg, world_size=dist_utils.process_world_size(), device_type=dist_utils.device_type(),
                               vocab_size=self.tokenizer.vocab_size)
        check_document_starts(self.run.document_mask, streaming=cfg.data.streaming, tokenizer=self.tokenizer)
        self.parallel_dims = self.run.parallel_dims
        self.model_args = self.run.model_args
        self.n_microbatches = self.run.n_microbatches
        self.converters = self.run.converters

        self.device = dist_utils.init_distributed()
        self.parallel_dims.build_mesh(self.device.type)
        set_determinism(cfg.training.seed, cfg.debug)
        logger.info("precision: %s (%s); model converters: %s",
                    self.run.precision.describe(init_scale=cfg.precision.init_scale), self.run.precision.reason,
                    describe_converters(cfg.model_converters.converters))
        logger.info("tokenizer: %s; model vocabulary %d", self.tokenizer.describe(), self.model_args.vocab_size)

    def _build_model_and_optimizers(self) -> None:
        """Precision, the loss, this rank's model parts and their optimizers, schedules and FP16 scaler."""
        cfg = self.config
        self.precision = cfg.precision.build(resolved=self.run.precision, device=self.device)
        if self.run.compiles and self.run.compile_backend == "inductor" and self.device.type == "cpu":
            if note := use_correct_cpu_vector_width():
                logger.warning(note)
        loss_fn = maybe_compile_loss(cross_entropy_sum, enabled=self.run.compile_loss, backend=self.run.compile_backend)
        built = build_model_parts(self.run, mp_policy=self.precision.mp_policy(), device=self.device,
                                  loss_fn=loss_fn, seed=cfg.training.seed, label=f"{cfg.model.name} {cfg.model.flavor}")
        self.model_parts = built.parts
        """The whole model, or this rank's pipeline stages."""
        self.runner = built.runner
        """Runs a batch through the parts: the whole model, or this rank's stages by the pipeline's schedule. Its
        ``loss_fn`` is the training loss."""
        self.flops_per_token = built.flops_per_token
        self.attention_flops_per_token = built.attention_flops_per_token
        self.sequence_layout = SequenceLayout(document_mask=self.run.document_mask, cp=self.parallel_dims.cp,
                                              cp_rank=self.parallel_dims.cp_rank)
        """Lays each batch out for the model: this rank's chunks under context parallelism (the CP ranks of one
        data shard read the same batches), positions and the attention mask's indices."""
        self.optimizers = cfg.optimizer.build(model_parts=self.model_parts)
        self.lr_schedulers = cfg.lr_scheduler.build(optimizers=self.optimizers, training_steps=cfg.training.steps)
        # Right after each applied optimizer step (not one the scaler or the spike policy skipped), each part
        # refreshes what follows its weights: the float8 scales of the next forward, MoE expert biases. One hook
        # per part on that part's optimizer, so a rank holding several pipeline stages updates each once.
        for part, optimizer in zip(self.model_parts, self.optimizers, strict=True):
            optimizer.register_step_post_hook(lambda *_, part=part: self.converters.post_optimizer_hook([part]))
            optimizer.register_step_post_hook(lambda *_, part=part: part.post_optimizer_step(self._batch_group()))
        self.grad_scaler = self.precision.grad_scaler(process_group=None)

    def _build_loop_components(self) -> None:
        """The data, the loop's state, the spike policy, checkpoints, metrics, validation and the signal watcher."""
        cfg = self.config
        self.dataloader = cfg.data.build(
            tokenizer=self.tokenizer, dp_rank=self.parallel_dims.dp_rank, dp_world_size=self.parallel_dims.dp_degree,
            seq_len=self.run.seq_len, local_batch_size=self.run.local_batch_size, split="train",
            infinite=True, seed=data_order_seed(cfg.training.seed), batches_per_step=self.n_microbatches,
            vocab_size=self.model_args.vocab_size,
        )
        self.train_state = TrainState()
        self.health = LossHealth()
        self.pending = PendingSteps()
        """Steps whose loss and norm are still on the device (read by ``_settle``)."""
        policy = cfg.training.spike_policy
        self.spike_guard = SpikeGuard(policy, self.health) if policy.enable else None
        self.last_verdict: Verdict | None = None
        """What the spike policy decided for the latest step (None with the policy off)."""
        states = {
            "model": ModelWrapper(self.model_parts),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
            "dataloader": self.dataloader,
            "train_state": self.train_state,
        }
        if self.grad_scaler is not None:
            states["grad_scaler"] = self.grad_scaler
        if self.spike_guard is not None:
            states["spike_guard"] = self.spike_guard
        self.checkpointer = cfg.checkpoint.build(
            dump_folder=cfg.job.dump_folder, states=states, model_args=self.model_args,
            model_spec=self.run.model_spec, data_layout=self.run.data_layout(cfg.data),
            run_config=config_to_toml(cfg), moe_top_k=None if self.run.moe_facts is None else self.run.moe_facts.top_k,
        )
        self.metrics = cfg.metrics.build(
            dump_folder=cfg.job.dump_folder, device=self.device,
            num_flops_per_token=self.flops_per_token, attention_flops_per_token=self.attention_flops_per_token,
            # Ranks holding different tokens: data shards times the CP ranks that split each sequence.
            dp_degree=self.parallel_dims.dp_degree * self.parallel_dims.cp,
            tp_degree=self.parallel_dims.tp * self.parallel_dims.pp,
        )
        self.spikes = None if self.spike_guard is None else SpikeResponse(
            self.spike_guard, checkpointer=self.checkpointer, metrics=self.metrics, health=self.health,
            device=self.device)
        self.validator = build_validator(
            cfg.validation, cfg.data, cfg.training, tokenizer=self.tokenizer, parallel_dims=self.parallel_dims,
            vocab_size=self.model_args.vocab_size, loss_fn=self.runner.loss_fn, device=self.device,
            dp_group=self._batch_group(), precision=self.precision, loss_parallel=self.run.loss_parallel,
            runner=self.runner, sequence_layout=self.sequence_layout)
        self.fp8_stats = build_fp8_stats(self.model_parts, freq=cfg.metrics.fp8_stats_freq, dp_group=self._batch_group())
        self.watcher = PreemptionWatcher(self.device)

    def _fp8_capture(self, on: bool) -> contextlib.AbstractContextManager[None]:
        """Measure the FP8 casts of this micro-batch (the first of a stats step), or do nothing."""
        return self.fp8_stats.capture() if on and self.fp8_stats is not None else contextlib.nullcontext()

    def _save_config(self) -> None:
        # Called once every refusal has passed (storage, the resume): a refused run leaves the file that
        # describes the folder as it was.
        if dist_utils.is_rank0() and self.config.job.save_config:
            save_resolved_config(self.config, dump_folder=self.config.job.dump_folder)

    def _batch_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold different tokens of one step (data x context parallel): every sum over a step's
        tokens (target tokens, loss, expert loads, statistics) runs over it."""
        mesh = self.parallel_dims.batch_mesh
        return None if mesh is None else mesh.get_group()

    # ----------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> None:
        cfg = self.config
        if cfg.checkpoint.create_seed_checkpoint:
            if (later_run := seed_over_later_run(cfg.job.dump_folder, cfg.checkpoint.folder)) is not None:
                logger.warning("%s", later_run)
            self.checkpointer.save(0, force=True, model_only=True)
            self._save_config()
            logger.info("seed checkpoint written to %s", os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))
            self.close()
            return
        self._resume()
        first_step = self.train_state.step + 1
        data_iter = iter(self.dataloader)
        if cfg.training.gc_freq > 0:
            gc.disable()
        logger.info("training %s steps from step %s, %s micro-batch(es) per step",
                    cfg.training.steps, self.train_state.step, self.n_microbatches)
        self.metrics.begin(self.train_state.step, cfg.training.steps)
        self._maybe_validate(force=self.train_state.step == 0)
        with cfg.profiling.build(dump_folder=cfg.job.dump_folder, start_step=self.train_state.step) as profiler:
            while self.train_state.step < cfg.training.steps:
                self.train_state.step += 1
                step = self.train_state.step
                if cfg.training.gc_freq > 0 and step % cfg.training.gc_freq == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                compiled_before = compile_stats() if step == first_step and self.run.compiles else None
                # Labelled so profiler traces show the data time per step (tokenisation is on demand).
                with torch.profiler.record_function("data_loading"):
                    if self.spikes is not None:
                        self.spikes.skip_data(step, data_iter, batches_per_step=self.n_microbatches)
                    batches = [next(data_iter) for _ in range(self.n_microbatches)]
                data_s = time.perf_counter() - t0
                self.train_step(batches)
                last = step == cfg.training.steps
                if self._after_step(step, last=last, first=step == first_step, t0=t0, data_s=data_s,
                                    compiled_before=compiled_before):
                    # Rolled back: the data restarts at the checkpoint's step.
                    data_iter = iter(self.dataloader)
                    profiler.step()
                    continue
                self._maybe_validate(force=last)
                preempted = self.watcher.should_stop()
                if preempted or self.checkpointer.due(step, last_step=last):
                    self._settle()  # nothing is saved from weights that a non-finite step has reached
                with self.metrics.exclude_from_throughput():
                    self.checkpointer.save(step, last_step=last, force=preempted)
                profiler.step()
                if preempted:
                    if cfg.checkpoint.enable:
                        logger.warning("stopped by signal after step %s; checkpoint saved", step)
                    else:
                        logger.warning("stopped by signal after step %s; no checkpoint written: "
                                       "--checkpoint.enable true keeps progress across preemptions", step)
                    break
        self.close()

    def _resume(self) -> None:
        """Load the checkpoint to resume from (if any), refuse what cannot resume, then write config.toml."""
        cfg = self.config
        self.checkpointer.check_storage()
        self.train_state.step = self.checkpointer.load()
        # run_train.sh refused this before launch; a direct launch (train.py, torchrun) is refused here, before
        # config.toml is written.
        check_steps_ahead(self.train_state.step, cfg.training.steps, self.checkpointer.folder)
        report_resumed_layout(self.checkpointer.loaded_data_layout, self.run, cfg.data, step=self.train_state.step,
                              data_loaded="dataloader" not in cfg.checkpoint.exclude_from_loading,
                              global_batch_set=cfg.training.global_batch_size > 0)
        if self.spikes is not None:
            self.spikes.resume(self.train_state.step)
        self._save_config()

    def _after_step(self, step: int, *, last: bool, first: bool, t0: float, data_s: float,
                    compiled_before: CompileStats | None) -> bool:
        """Read, log and report the step just trained; on the spike policy's rollback verdict, roll back and
        return True. ``first``: the run's first step, whose time is logged from ``t0`` (when it began),
        ``data_s`` (its seconds loading data) and ``compiled_before`` (the compile counters before it, None
        when nothing compiles)."""
        cfg = self.config
        verdict = self.last_verdict
        logged = last or self.metrics.should_log(step)
        # The loss and norm stay on the device until a log step (or a save, validation, rollback) reads them.
        values = self._settle() if logged else None
        if first:
            step_s = time.perf_counter() - t0
            compiled = ("" if compiled_before is None else
                        f", {first_step_compile_label(compiled_before, compile_stats(), step_s=step_s)}")
            logger.info("first step took %.1fs (%.1fs loading data%s)", step_s, data_s, compiled)
        if values is not None:
            model_scalars, model_summary = model_stats(self.model_parts, self.runner, dp_group=self._batch_group())
            # The logged loss is the mean since the previous log line (one step's batch is a noisy
            # sample); the step's own loss goes to TensorBoard as train/loss_step.
            mean_loss = self.train_state.take_mean_loss(fallback=values.loss)
            self.metrics.log(step, loss=mean_loss, grad_norm=values.grad_norm,
                             lr=self.lr_schedulers.last_lr, extra=extra_metrics(self.grad_scaler),
                             scalars=model_scalars | {"train/loss_step": values.loss} | data_scalars(self.dataloader),
                             summary=model_summary)
        if self.spikes is not None and verdict is not None:
            self.spikes.report(step, verdict, logged=logged)
            if verdict.action == "rollback":
                self._settle()  # the steps before the spike vouch for the checkpoints to go back to
                # Every state, the step included, comes back from the checkpoint; the data restarts there.
                self.train_state.step = self.spikes.roll_back(total_steps=cfg.training.steps)
                return True
        return False

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``batches``; returns the loss (summed over the batch group) and the
        gradient norm as device scalars, and queues them for the loop to read (``PendingSteps``). Nothing
        here reads a device value except what decides this step: the FP16 scaler's overflow flag, the
        spike policy's verdict, FP8 statistics on their steps."""
        # Laid out first: under context parallelism this rank's labels are its chunks, and the target tokens of
        # the step are counted over the ranks that hold them.
        laid_out = [self.sequence_layout(batch) for batch in batches]
        global_tokens = global_target_tokens([mb.labels for mb in laid_out], self.device, self._batch_group())
        loss_total = torch.zeros((), device=self.device)
        fp8_stats_step = self.fp8_stats is not None and self.fp8_stats.due(self.train_state.step)
        set_aux_loss_weight(self.model_parts, n_batches=len(batches), forwards_per_batch=self.runner.forwards_per_batch,
                            parallel_dims=self.parallel_dims,
                            loss_scale=self.grad_scaler.scale_value if self.grad_scaler is not None else 1.0)
        for i, host_batch in enumerate(laid_out):
            # non_blocking: a blocking host-to-device copy waits for the device to finish all queued work.
            mb = host_batch.to(self.device, non_blocking=True)
            self.train_state.tokens_seen += mb.inputs.numel()
            self.metrics.record_tokens(mb.inputs.numel(), attention_share=mb.attention_share)
            with (self._fp8_capture(fp8_stats_step and i == 0), self.precision.autocast(),
                  loss_parallel_context(self.run.loss_parallel)):
                loss = self.runner.step(mb.inputs, mb.labels, global_tokens=global_tokens, objective=self._scaled,
                                        model_kwargs=mb.model_kwargs)
            loss_total += local_loss(loss)

        overflow = self.grad_scaler is not None and self.grad_scaler.unscale_(self.optimizers)
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, pp_mesh=self.parallel_dims.pp_mesh)
        # Under a pipeline only the last stage's rank computed the loss: every rank logs, checks and judges that one.
        loss_total = sum_over(share_loss(loss_total, self.runner), self._batch_group())
        step = self.train_state.step
        verdict: Verdict | None = None
        if self.spikes is None:
            # Read later, with the non-finite check, by the loop (``_settle``).
            self.pending.add(step, loss_total, grad_norm, applied=True)
        else:
            verdict, (loss_value, norm_value) = self.spikes.judge(step, loss_total, grad_norm, overflow=overflow)
            self.pending.add_read(step, loss_value, norm_value, applied=verdict.updates)
        self.last_verdict = verdict
        applies = verdict is None or verdict.updates
        if self.grad_scaler is not None:
            if applies:
                self.grad_scaler.step(self.optimizers)  # skips the update itself on an overflow
            # A spike-skipped step had finite gradients: to the scaler a clean step, not one of its own skips.
            self.grad_scaler.update()
        elif applies:
            self.optimizers.step()
        # The schedule follows the step number: a skipped step advances it as an FP16 overflow skip does.
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        if fp8_stats_step and self.fp8_stats is not None:
            # Before the finiteness check: the casts of a step that went non-finite are worth seeing.
            self.metrics.log_fp8_stats(self.train_state.step, self.fp8_stats.collect())
        return loss_total, grad_norm

    def _scaled(self, objective: torch.Tensor) -> torch.Tensor:
        """What backward differentiates: the objective, times the FP16 loss scale when there is a scaler."""
        return self.grad_scaler.scale(objective) if self.grad_scaler is not None else objective

    def _settle(self) -> StepValues | None:
        """``settle`` this trainer's queued steps; a non-finite one stops the run unless the spike policy is on
        (which has judged each step already)."""
        return settle(self.pending, health=self.health, train_state=self.train_state, checkpointer=self.checkpointer,
                      stop_nonfinite=self.spikes is None, scaled=self.grad_scaler is not None,
                      clipping=self.config.training.max_norm > 0, fp16=self.precision.param_dtype == torch.float16)

    def _maybe_validate(self, *, force: bool) -> None:
        if self.validator is None:
            return
        step = self.train_state.step
        if force or (step > 0 and step % self.config.validation.freq == 0):
            self._settle()  # a non-finite step stops the run before its weights are validated
            with self.metrics.exclude_from_throughput():
                val_loss = self.validator.validate(self.model_parts, step)
            self.metrics.log_validation(step, val_loss, by_source=self.validator.last_by_source)

    def close(self) -> None:
        self.watcher.close()
        self.checkpointer.close()
        self.metrics.close()
        if self.config.training.gc_freq > 0:
            gc.enable()

