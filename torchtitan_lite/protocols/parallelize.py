"""What parallelize decides from besides the family's plan: the run's layout as ``resolve_run`` settled it.

``ResolvedRun.parallelize_context`` fills it in; ``parallelize`` (torchtitan_lite/distributed/parallelize.py)
reads nothing else of the run, so it depends only on the parallel degrees and the config sections below
them, never on the run or the trainer above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan_lite.config.sections import ActivationCheckpointConfig
from torchtitan_lite.mesh.parallel_dims import ParallelDims


@dataclass(frozen=True)
class ParallelizeContext:
    parallel_dims: ParallelDims
    """Degrees and meshes (built before parallelize is called)."""
    mp_policy: MixedPrecisionPolicy
    """FSDP's parameter / reduction dtypes; without data parallelism autocast casts instead."""
    sequence_parallel: bool
    """Norms and the residual stream are sharded along the sequence (TP > 1 and enabled)."""
    loss_parallel: bool
    """Logits stay sharded by vocabulary (TP > 1 and enabled)."""
    activation_checkpoint: ActivationCheckpointConfig
    compile_model: bool
    """The transformer blocks are compiled: decided once by ``resolve_run`` (compile.enable with 'model' in
    compile.components), so parallelize never re-decides it from the config section."""
    compile_backend: str
    """torch.compile backend of the blocks (compile.backend); read only when ``compile_model``."""
    compile_fullgraph: bool
    """Each compiled block must be one graph (compile.fullgraph); read only when ``compile_model``."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"]
    fsdp_cpu_offload: bool

