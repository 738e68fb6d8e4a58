"""One resolved run: every fact derived from the config, computed once, in one place.

``resolve_run(config, ...)`` turns the root config plus the launch (world size, device type, the
tokenizer's vocabulary) into a ``ResolvedRun``: validated parallel degrees, model args, the precision
policy with 'auto' decided, micro-batches per step, what is compiled, and the model converters with their
cross-section rules checked. The trainer, ``--check-config``, ``--estimate-memory``, ``--print-fp8-plan``
and the dry run all consume this object, so they cannot disagree, and everything a build would reject is
rejected here, before any process group or model exists.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan_lite.components.data.layout import DataLayout
from torchtitan_lite.components.precision import ResolvedPrecision, resolve_precision
from torchtitan_lite.config.sections import (
    ActivationCheckpointConfig,
    CompileConfig,
    ModelConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan_lite.distributed.pipeline.layout import PipelineLayout, check_pipeline_expert_parallel, resolve_pipeline
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.model_converter import ConversionContext, ModelConvertersContainer
from torchtitan_lite.protocols.model_shape import ModelShape
from torchtitan_lite.protocols.model_spec import ModelSpec, RunFacts, build_model_args, get_model_spec
from torchtitan_lite.protocols.moe_facts import MoEFacts
from torchtitan_lite.protocols.parallelize import ParallelizeContext

if TYPE_CHECKING:
    from torchtitan_lite.components.checkpoint import CheckpointManager
    from torchtitan_lite.components.data import TextDataLoader
    from torchtitan_lite.components.metrics import MetricsProcessor
    from torchtitan_lite.components.optimizer import Implementation, LowBit, OptimizersContainer
    from torchtitan_lite.components.precision import Precision
    from torchtitan_lite.components.tokenizer import Tokenizer
    from torchtitan_lite.components.validate import Validator

logger = logging.getLogger("torchtitan_lite")


class RunConfig(Protocol):
    """The sections of the root config (``Trainer.Config``) that a run is resolved from."""

    model: ModelConfig
    tokenizer: Tokenizer.Config
    training: TrainingConfig
    precision: Precision.Config
    parallelism: ParallelismConfig
    activation_checkpoint: ActivationCheckpointConfig
    compile: CompileConfig
    model_converters: ModelConvertersContainer.Config
    optimizer: OptimizersContainer.Config
    validation: Validator.Config
    checkpoint: CheckpointManager.Config
    metrics: MetricsProcessor.Config


@dataclass(frozen=True)
class ResolvedRun:
    world_size: int
    device_type: str
    """'cuda' or 'cpu': where the ranks compute (a CUDA job may be resolved on a host without GPUs)."""
    parallel_dims: ParallelDims
    model_spec: ModelSpec
    model_args: ModelShape
    """The family's args, flavor overrides applied and the vocabulary grown to the tokenizer's; the core reads
    only their shape (the family's own fields are the family's to read)."""
    moe_facts: MoEFacts | None
    """The model's MoE layers, as the family states them (ModelSpec.moe_facts); None: a dense model."""
    precision: ResolvedPrecision
    n_microbatches: int
    """Forward/backward passes per optimizer step (gradient accumulation)."""
    compile_model: bool
    """The transformer blocks are compiled."""
    compile_loss: bool
    compile_backend: str
    """torch.compile backend of the blocks and the loss (compile.backend); read only when something compiles."""
    compile_fullgraph: bool
    """Each compiled block must be one graph (compile.fullgraph)."""
    sequence_parallel: bool
    """Norms and the residual stream are sharded along the sequence (TP > 1 and enabled)."""
    loss_parallel: bool
    """Logits stay sharded by vocabulary and the loss runs on the shards (TP > 1 and enabled)."""
    converters: ModelConvertersContainer
    pipeline: PipelineLayout | None
    """Stages, their blocks and the schedule under pipeline parallelism; None without it (pp 1)."""
    document_mask: bool
    """Attention stays within each document of a window (model.attention_mask='document')."""
    seq_len: int
    """Tokens per sequence (training.seq_len)."""
    local_batch_size: int
    """Sequences per rank and micro-batch (training.local_batch_size)."""
    tokens_per_forward: int
    """Tokens one forward of the model sees on a rank: a pipeline micro-batch's under a pipeline, a local
    batch's otherwise (what activations and float8 casts are sized by)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"]
    """parallelism.fsdp_reshard_after_forward with 'default' decided under a pipeline (``reshard_after_forward``)."""
    fsdp_cpu_offload: bool
    """FSDP keeps sharded parameters, gradients and optimizer states on the host."""
    ac_mode: Literal["none", "full", "selective"]
    """Activation checkpointing (activation_checkpoint.mode)."""
    ac_selective_option: str
    """With ac_mode 'selective': 'op' or every Nth block (activation_checkpoint.selective_option)."""
    optimizer_low_bit: LowBit | None
    """Low-bit AdamW states (optimizer.low_bit); None: float32 states."""
    optimizer_implementation: Implementation
    """The optimizer step's implementation (optimizer.implementation), which sizes its scratch."""

    @property
    def compiles(self) -> bool:
        """Something is compiled, the blocks or the loss: what the CPU vector-width probe and the first step's
        compile report follow."""
        return self.compile_model or self.compile_loss

    @property
    def tokens_per_microbatch(self) -> int:
        return self.local_batch_size * self.seq_len

    def data_layout(self, data: TextDataLoader.Config) -> DataLayout:
        """How this run feeds ``data``: recorded in its checkpoints, compared on resume."""
        return DataLayout(dp_degree=self.parallel_dims.dp_degree, local_batch_size=self.local_batch_size,
                          n_microbatches=self.n_microbatches, seq_len=self.seq_len, dataset=data.describe_source(),
                          streaming=data.streaming, position="stream" if data.streaming else "windows")

    def parallelize_context(self, *, mp_policy: MixedPrecisionPolicy) -> ParallelizeContext:
        """What ``parallelize`` needs of this run, with FSDP's ``mp_policy``."""
        return ParallelizeContext(
            parallel_dims=self.parallel_dims, mp_policy=mp_policy, sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            activation_checkpoint=ActivationCheckpointConfig(mode=self.ac_mode, selective_option=self.ac_selective_option),
            compile_model=self.compile_model, compile_backend=self.compile_backend,
            compile_fullgraph=self.compile_fullgraph,
            fsdp_reshard_after_forward=self.fsdp_reshard_after_forward,
            fsdp_cpu_offload=self.fsdp_cpu_offload,
        )


def resolve_run(config: RunConfig, *, world_size: int, device_type: str, vocab_size: int | None = None,
                cuda_available: bool | None = None) -> ResolvedRun:
    """Resolve ``config`` for a launch of ``world_size`` ranks on ``device_type``.

    ``vocab_size`` is the tokenizer's (the model's vocabulary grows to it); None reads it from the
    tokenizer config without training the default tokenizer, and plans with the flavor's vocabulary when
    tokenizer.path does not exist yet (the actions that do not read data). Initial weights
    (checkpoint.initial_load_path) fix the embedding's rows: a larger tokenizer is an error.
    ``cuda_available`` (default: whether this process sees a GPU) False with device_type 'cuda' resolves a
    GPU job from a host without one.
    """
    par, training, ac = config.parallelism, config.training, config.activation_checkpoint
    dims = ParallelDims(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, world_size=world_size,
                        ep=par.ep, pp=par.pp, cp=par.cp)
    spec = get_model_spec(config.model.name)
    args = resolve_model_args(config, spec, vocab_size)
    # Decided once: the pipeline schedule, the family's rules, the converters and parallelize all read it.
    compile_model = config.compile.enable and "model" in config.compile.components
    pipeline = resolve_pipeline(
        pp=par.pp, schedule=par.pipeline_schedule, stages_per_rank=par.pipeline_stages_per_rank,
        microbatch_size=par.pipeline_microbatch_size, split_points=par.pipeline_split_points,
        layers_per_stage=par.pipeline_layers_per_stage, n_layers=args.n_layers,
        local_batch_size=training.local_batch_size, blocks=spec.parallel_plan.blocks,
        tied_embeddings=args.tie_word_embeddings,
        compiled_blocks=compile_model)
    moe_facts = spec.moe_facts(args) if spec.moe_facts is not None else None
    check_expert_parallel(dims.ep, moe_facts, config.model, ac)
    check_pipeline_expert_parallel(pipeline, ep=dims.ep, ac_mode=ac.mode)
    sequence_parallel = dims.tp_enabled and par.enable_sequence_parallel
    dims.validate_for_model(args, training.seq_len, sequence_parallel=sequence_parallel)
    precision = resolve_precision(config.precision, device_type=device_type, fsdp_enabled=dims.fsdp_enabled,
                                  cuda_available=cuda_available)
    if spec.check_run is not None:
        spec.check_run(RunFacts(model_args=args, compile_model=compile_model, param_dtype=precision.param_dtype,
                                tp=dims.tp))
    # The tokens one forward of a rank's Linears sees: under context parallelism a rank holds seq_len / cp of
    # each sequence (what the FP8 filters size the GEMMs by).
    tokens_per_forward = training.seq_len // dims.cp * (pipeline.microbatch_size if pipeline is not None
                                                        else training.local_batch_size)
    context = ConversionContext(
        device_type=device_type, param_dtype=precision.param_dtype, autocast=precision.autocast,
        fsdp_sharded=dims.fsdp_enabled, tp_enabled=dims.tp_enabled, compile_model=compile_model,
        seq_len=training.seq_len, output_module=spec.parallel_plan.output, blocks=spec.parallel_plan.blocks,
        # FSDP shards over dp_shard x cp: CP ranks hold the same weights and join the FSDP group.
        dp_shard=dims.dp_shard * dims.cp if dims.fsdp_enabled else 1, tp=dims.tp,
        tp_shard_dim=spec.parallel_plan.tp_shard_dim,
        tokens_per_forward=tokens_per_forward, ep=dims.ep,
    )
    converters = resolve_converters(config, context)
    return ResolvedRun(
        world_size=world_size, device_type=device_type, parallel_dims=dims, model_spec=spec, model_args=args,
        moe_facts=moe_facts,
        precision=precision, n_microbatches=microbatches_per_step(training, dims.dp_degree),
        compile_model=compile_model, compile_loss=config.compile.enable and "loss" in config.compile.components,
        compile_backend=config.compile.backend, compile_fullgraph=config.compile.fullgraph,
        sequence_parallel=sequence_parallel, loss_parallel=dims.tp_enabled and par.enable_loss_parallel,
        converters=converters, pipeline=pipeline, document_mask=config.model.attention_mask == "document",
        seq_len=training.seq_len, local_batch_size=training.local_batch_size, tokens_per_forward=tokens_per_forward,
        fsdp_reshard_after_forward=reshard_after_forward(par.fsdp_reshard_after_forward, pipelined=pipeline is not None),
        fsdp_cpu_offload=par.fsdp_cpu_offload, ac_mode=ac.mode, ac_selective_option=ac.selective_option,
        optimizer_low_bit=config.optimizer.low_bit, optimizer_implementation=config.optimizer.implementation,
    )


def resolve_model_args(config: RunConfig, spec: ModelSpec, vocab_size: int | None) -> ModelShape:
    """The flavor's args with the config's overrides, the vocabulary grown to the tokenizer's ``vocab_size``
    (None: read from the tokenizer config; unknown until the tokenizer is fetched) and kept at the initial
    weights' embedding rows, which a larger tokenizer cannot use."""
    if vocab_size is None:
        vocab_size = planned_vocab_size(config.tokenizer)
    embedding_rows = initial_weights_vocab_size(config.checkpoint, f"model.{spec.parallel_plan.embedding}.weight")
    if embedding_rows is not None and vocab_size is not None and vocab_size > embedding_rows:
        raise ValueError(
            f"the tokenizer ({config.tokenizer.path}) has {vocab_size} ids, more than the {embedding_rows} embedding "
            f"rows of the initial weights checkpoint.initial_load_path={config.checkpoint.initial_load_path!r}: ids "
            f"from {embedding_rows} on would have no embedding. Use the tokenizer those weights were trained with, "
            f"or train from scratch (unset checkpoint.initial_load_path)")
    args: ModelShape = build_model_args(spec, config.model.flavor, n_layers=config.model.n_layers,
                                        vocab_size=embedding_rows, min_vocab_size=vocab_size,
                                        hf_config=config.model.hf_config)
    if vocab_size is None:
        logger.info("tokenizer.path=%r does not exist yet: planning with the %s flavor's vocabulary of %d; a training "
                    "launch needs the tokenizer (--check-config says how to fetch it)", config.tokenizer.path,
                    config.model.flavor, args.vocab_size)
    return args


def resolve_converters(config: RunConfig, context: ConversionContext) -> ModelConvertersContainer:
    """The run's model converters, built for ``context``, with the rules that tie them to other sections."""
    converters = config.model_converters.build(context=context)
    check_validation_precision(config.validation, converters, tp_enabled=context.tp_enabled)
    if config.metrics.fp8_stats_freq > 0 and not converters.converters:
        raise ValueError(f"metrics.fp8_stats_freq={config.metrics.fp8_stats_freq} measures FP8 / MX Linears, but "
                         f"model_converters.converters is empty; add a float8 converter (e.g. --config "
                         f"llama3_debug_fp8) or set metrics.fp8_stats_freq=0")
    return converters


def reshard_after_forward(setting: Literal["default", "always", "never"], *,
                          pipelined: bool) -> Literal["default", "always", "never"]:
    """parallelism.fsdp_reshard_after_forward with 'default' decided: under a pipeline every micro-batch's forward
    and backward would gather a resharded unit again, so the stages keep their weights gathered ('never');
    otherwise 'default' (every block but the last resharded)."""
    return "never" if setting == "default" and pipelined else setting


def check_expert_parallel(ep: int, facts: MoEFacts | None, model: ModelConfig,
                          ac: ActivationCheckpointConfig) -> None:
    """parallelism.ep splits routed experts: the model must have them, in a number ep divides, and per-op
    selective checkpointing cannot replay the experts' own FSDP unit. The only expert-parallel check: parallelize
    runs on a resolved run and does not repeat it."""
    if ep == 1:
        return
    if facts is None:
        raise ValueError(
            f"parallelism.ep={ep} splits routed experts over ranks, but model {model.name} (flavor {model.flavor}) "
            f"is dense: it has no MoE layers. Set --parallelism.ep 1 (FSDP shards it over dp_shard), or train an "
            f"MoE family (e.g. --config qwen3_moe_debug)")
    facts.check_ep(ep)
    if ac.mode == "selective" and ac.selective_option == "op":
        # torch 2.13's selective checkpointing replays ops by count, and the experts' own FSDP unit inside the
        # block runs its all-gather hooks a different number of times in the recomputation.
        raise ValueError(
            f"activation_checkpoint.mode=selective with selective_option=op does not work with expert parallelism "
            f"(parallelism.ep={ep}) on this PyTorch: per-op checkpointing cannot replay the experts' FSDP hooks; use "
            "--activation_checkpoint.mode full, or --activation_checkpoint.selective_option 2 (every 2nd block)")


def check_validation_precision(validation: Validator.Config, converters: ModelConvertersContainer, *,
                               tp_enabled: bool) -> None:
    """validation.low_precision=False runs FP8 Linears as plain Linears: refuse the layouts that hand them
    float8 data (FSDP float8 all-gather, float8 tensor-parallel communication), and say when it is moot."""
    if not validation.enable or validation.low_precision:
        return
    if not converters.converters:
        logger.info("validation.low_precision=False has no effect: no model converter makes Linears low precision")
        return
    for converter in converters.converters:
        recipe = getattr(converter.config, "recipe_name", None)
        if getattr(converter, "fsdp_float8_all_gather", False):
            raise ValueError(
                "validation.low_precision=False (validation in the high-precision policy) cannot be honoured with "
                "enable_fsdp_float8_all_gather: FSDP all-gathers the weights as float8, so the Linears never see "
                "their high-precision weights. Set validation.low_precision=true, or turn the float8 all-gather off")
        if tp_enabled and converter.config.kind == "float8" and recipe == "tensorwise":
            raise ValueError(
                "validation.low_precision=False (validation in the high-precision policy) cannot be honoured with "
                "tensor parallelism and the tensorwise float8 recipe: its inputs and output gradients are cast to "
                "float8 before the tensor-parallel communication, outside the Linears. Set "
                "validation.low_precision=true, or use a rowwise recipe")


def microbatches_per_step(training: TrainingConfig, dp_degree: int) -> int:
    """global_batch_size / (local_batch_size x dp degree); anything but an exact multiple is an error."""
    per_pass = training.local_batch_size * dp_degree
    global_batch = per_pass if training.global_batch_size < 0 else training.global_batch_size
    if global_batch % per_pass != 0:
        raise ValueError(
            f"training.global_batch_size={global_batch} must be a multiple of training.local_batch_size "
            f"x data-parallel degree = {training.local_batch_size} x {dp_degree} = {per_pass}; "
            f"use {max(per_pass, global_batch // per_pass * per_pass)} or -1"
        )
    return global_batch // per_pass


def planned_vocab_size(tokenizer_config: Tokenizer.Config) -> int | None:
    """The vocabulary the trainer will size the model with, without building the default tokenizer; None
    when tokenizer.path does not exist (not fetched yet). A path that exists but does not load is an error."""
    if tokenizer_config.path is None:
        # The default tokenizer is trained to exactly this size: no need to build (or train) it here.
        return tokenizer_config.vocab_size
    if not Path(tokenizer_config.path).expanduser().exists():
        return None
    return tokenizer_config.build().vocab_size


def initial_weights_vocab_size(checkpoint_config: CheckpointManager.Config, embedding_key: str) -> int | None:
    """Embedding rows of the DCP checkpoint at checkpoint.initial_load_path (its metadata only); None
    without one. A path that is not a DCP folder is left to the checkpoint manager, which explains it."""
    from torchtitan_lite.components.checkpoint.layout import is_dcp_folder
    from torchtitan_lite.components.checkpoint.verify import read_metadata, saved_tensor_shape

    path = checkpoint_config.initial_load_path
    if path is None or not is_dcp_folder(path):
        return None
    shape = saved_tensor_shape(read_metadata(path), embedding_key)
    return None if shape is None else shape[0]
