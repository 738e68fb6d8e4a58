"""What a memory estimate is made of: its terms (one per component, memory/estimate.py lists them) and the
moments of a step, with the peak and the per-device total they give."""
from __future__ import annotations

from dataclasses import dataclass

from torchtitan_lite.memory.timeline import Moment

GIB = 1024**3

CUDA_CONTEXT_BYTES = 768 * 1024**2
"""CUDA context, loaded kernels, cuBLAS/NCCL internal buffers: device memory that nvidia-smi shows but
torch.cuda.max_memory_allocated() does not (typically 0.5-1 GiB on H100 with torch 2.x + NCCL)."""


@dataclass(frozen=True)
class MemoryTerm:
    name: str
    nbytes: int
    how: str


@dataclass(frozen=True)
class MemoryEstimate:
    terms: tuple[MemoryTerm, ...]
    """Size of each component (its largest value during the step for transient ones)."""
    moments: tuple[Moment, ...]
    """Device bytes allocated at each candidate peak moment of a step (memory/timeline.py)."""
    layout: str
    device_type: str
    world_size: int
    model: str = ""
    """Total and active parameters of the model."""
    all_gather: str = ""
    """Bytes per weight element FSDP all-gathers, per recipe and why ('' without FSDP)."""
    pp_rank: int | None = None
    """Under pipeline parallelism: the pipeline rank this estimate is of (None without a pipeline)."""
    stages: str = ""
    """Under pipeline parallelism: the rank's stages and the micro-batches each holds at most."""

    def __getitem__(self, name: str) -> int:
        for term in self.terms:
            if term.name == name:
                return term.nbytes
        raise KeyError(f"no memory term {name!r}; terms: {[t.name for t in self.terms]}")

    @property
    def parameters(self) -> int:
        return self["parameters"]

    @property
    def gradients(self) -> int:
        return self["gradients"]

    @property
    def optimizer_states(self) -> int:
        return self["optimizer states"]

    def moment(self, name: str) -> Moment:
        for moment in self.moments:
            if moment.name == name:
                return moment
        raise KeyError(f"no moment {name!r}; moments: {[m.name for m in self.moments]}")

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda m: m.nbytes)

    @property
    def peak_allocated(self) -> int:
        """Peak bytes held by the framework's allocator (torch.cuda.max_memory_allocated on CUDA)."""
        return self.peak_moment.nbytes

    @property
    def total(self) -> int:
        """Peak device memory including the CUDA context the allocator does not see."""
        return self.peak_allocated + (CUDA_CONTEXT_BYTES if self.device_type == "cuda" else 0)
