"""Config sections that configure the training job itself rather than a buildable component."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from torchtitan_lite.config.dump_folder import OUTPUTS_ROOT
from torchtitan_lite.config.spike_policy import SpikePolicyConfig


@dataclass(kw_only=True)
class JobConfig:
    dump_folder: str = OUTPUTS_ROOT
    """Root folder of the run's outputs: config.toml, tb/ (TensorBoard), checkpoint/, profiles/. A registered
    config that leaves it at ./outputs writes to ./outputs/<config name>: one folder per config, so a run never
    resumes another config's checkpoints."""
    description: str = ""
    """Free text describing the run; saved with the config."""
    save_config: bool = True
    """Write the resolved config to <dump_folder>/config.toml once the run has passed its checks and loaded its
    checkpoint (a refused run leaves the file as it was). Each checkpoint holds its own copy either way."""

    def __post_init__(self) -> None:
        if not self.dump_folder:
            raise ValueError(f"job.dump_folder='' is empty; give a folder, e.g. {OUTPUTS_ROOT}/my_run")
        if os.path.exists(self.dump_folder) and not os.path.isdir(self.dump_folder):
            raise ValueError(f"job.dump_folder={self.dump_folder} is a file, not a folder; choose another path")


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "llama3"
    """Model family, a key of models.MODEL_SPECS."""
    flavor: str = "debug"
    """Size preset from the family's flavor table (debug, 1B, 3B, 8B, 70B, 405B for llama3)."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks (e.g. an 8B-width model that fits one GPU)."""
    hf_config: str | None = None
    """A Hugging Face config.json (qwen3_moe, deepseek_v3) whose architecture replaces the flavor's: its widths,
    depth, experts and rotary settings; the flavor still gives what the file has no field for (balancing, init).
    scripts/convert_from_hf.py sets it in the config.toml of a model no flavor has the shape of."""
    attention_mask: Literal["causal", "document"] = "causal"
    """'causal': each token attends to every earlier token of its window, across the documents packed into it.
    'document': only to the earlier tokens of its own document, with rotary positions restarting at each
    document's first token (as transformers reads restarting position_ids for every family). Document starts are
    the data's (a token store's document index, a stream's BOS tokens); MFU counts the attention done."""

    def __post_init__(self) -> None:
        if self.n_layers is not None and self.n_layers < 1:
            raise ValueError(f"model.n_layers={self.n_layers} must be >= 1 (or unset for the flavor's)")
        if self.attention_mask not in ("causal", "document"):
            raise ValueError(f"model.attention_mask={self.attention_mask!r} must be 'causal' or 'document'")


@dataclass(kw_only=True)
class TrainingConfig:
    steps: int = 300
    """Number of optimizer steps to train."""
    seq_len: int = 256
    """Tokens per training sample (windows of seq_len + 1 tokens are packed from the corpus)."""
    local_batch_size: int = 8
    """Samples per data-parallel rank per micro-batch."""
    global_batch_size: int = -1
    """Samples per optimizer step over all data-parallel ranks; -1 means local_batch_size x dp degree.
    A multiple of that product turns on gradient accumulation."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold; 0 disables clipping (the norm is still logged)."""
    seed: int | None = 0
    """Random seed for model init, data order and dropout-free sampling; None leaves RNGs unseeded."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC is disabled); 0 keeps it automatic."""
    spike_policy: SpikePolicyConfig = field(default_factory=SpikePolicyConfig)
    """Loss spikes: skip the update of a spiking step; past a limit roll back and skip the data around it."""

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "local_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name}={getattr(self, name)} must be >= 1")
        if self.global_batch_size < 1 and self.global_batch_size != -1:
            raise ValueError(f"training.global_batch_size={self.global_batch_size} must be >= 1, or -1 for "
                             f"local_batch_size x dp degree")
        if not self.max_norm >= 0:  # also refuses nan
            raise ValueError(f"training.max_norm={self.max_norm} must be >= 0 (0 disables clipping)")
        if self.gc_freq < 0:
            raise ValueError(f"training.gc_freq={self.gc_freq} must be >= 0 (0 keeps Python's automatic GC)")


@dataclass(kw_only=True)
class ParallelismConfig:
    dp_replicate: int = 1
    """Data-parallel replicate degree (HSDP when > 1 together with dp_shard > 1)."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 takes what is left of the world size after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models): the routed experts are split over this many of the dp_shard
    ranks, with all-to-all token dispatch; expert weights are FSDP-sharded over the dp_shard / ep ranks left.
    Must divide dp_shard."""
    cp: int = 1
    """Context-parallel degree: each sequence is cut into 2 x cp chunks and rank r of a CP group holds chunks r
    and 2 cp - 1 - r (equal causal work per rank); the CP ranks hold the same weights, so FSDP shards over
    dp_shard x cp. training.seq_len must be a multiple of 2 x cp. Only 1 runs today: context-parallel attention
    does not exist yet."""
    enable_sequence_parallel: bool = True
    """With TP, shard norms and residual activations along the sequence dimension."""
    enable_loss_parallel: bool = True
    """With TP, compute cross-entropy on vocab-sharded logits without gathering them."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """'default' reshards every block but the last (its params are needed again at once in backward)."""
    fsdp_cpu_offload: bool = False
    """Keep sharded params, grads and optimizer states on CPU (CUDA only)."""
    pp: int = 1
    """Pipeline-parallel degree: the model is split into stages along its blocks, one group of pp ranks
    passes activations stage to stage (outermost mesh dimension, so stages may span hosts)."""
    pipeline_schedule: Literal["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    """Pipeline schedule (torch.distributed.pipelining). 1F1B holds one stage per rank; Interleaved1F1B loops
    over several stages per rank (rank r holds stages r, r + pp, ...); ZBVZeroBubble and DualPipeV hold two
    stages per rank in a V (rank r holds stages r and 2 pp - 1 - r); they split each backward into an
    input-gradient and a weight-gradient pass, which compiled blocks do not allow (compile only the loss)."""
    pipeline_stages_per_rank: int = 0
    """Stages each pipeline rank holds; 0 takes the schedule's own (1 for 1F1B, 2 for the others). Only
    Interleaved1F1B accepts more than 2."""
    pipeline_microbatch_size: int = 1
    """Samples per pipeline micro-batch: each local batch (training.local_batch_size samples) is cut into
    local_batch_size / pipeline_microbatch_size micro-batches that flow through the stages. Gradient
    accumulation (training.global_batch_size) repeats the whole pipeline step on further local batches."""
    pipeline_split_points: list[str] = field(default_factory=list)
    """Explicit stage boundaries: the first block of every stage but the first, e.g. ['layers.4', 'layers.8']
    (pp x stages per rank - 1 names, in order). Empty: the automatic split."""
    pipeline_layers_per_stage: int = 0
    """Blocks per stage for the automatic split, counting the embedding and the output head as one block each
    (so the first and last stages hold one block fewer); it then decides the number of stages, which must be a
    multiple of pp. 0: split the blocks as evenly as that rule allows into pp x stages-per-rank stages."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "ep", "pp", "cp", "pipeline_microbatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(f"parallelism.dp_shard={self.dp_shard} must be >= 1, or -1 for what the world size leaves")
        for name in ("pipeline_stages_per_rank", "pipeline_layers_per_stage"):
            if getattr(self, name) < 0:
                raise ValueError(f"parallelism.{name}={getattr(self, name)} must be >= 0 (0 chooses automatically)")
        if self.pipeline_split_points and self.pipeline_layers_per_stage:
            raise ValueError("parallelism.pipeline_split_points and parallelism.pipeline_layers_per_stage both set "
                             "the split: keep one (split points name each stage's first block)")


@dataclass(kw_only=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block), or selective."""
    selective_option: str = "op"
    """With mode=selective: 'op' saves every other matmul output (in forward order; the rest are
    recomputed), the attention outputs and float8 amax reductions, and recomputes the elementwise ops;
    an integer N checkpoints every Nth block fully."""


@dataclass(kw_only=True)
class CompileConfig:
    enable: bool = False
    """torch.compile each transformer block and the loss."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile when enabled: 'model' (per transformer block) and/or 'loss'."""
    backend: str = "inductor"
    """torch.compile backend."""
    fullgraph: bool = True
    """Require each compiled block to be one graph (fails loudly on graph breaks)."""


@dataclass(kw_only=True)
class DebugConfig:
    deterministic: bool = False
    """Use deterministic algorithms (slower); for bitwise-reproducible runs."""
    detect_anomaly: bool = False
    """Enable autograd anomaly detection (very slow; finds the op that produced a NaN)."""
