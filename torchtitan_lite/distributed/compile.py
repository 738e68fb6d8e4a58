"""torch.compile per transformer block (after activation checkpointing, before FSDP) and of the loss.

Blocks are compiled one by one (``Module.compile``, so FSDP's per-block hooks and collectives stay outside
the graphs and parameter names are unchanged), yet compiled once per block *kind*: every block runs the
same code object, and dynamo treats each block's parameters and buffers as graph inputs rather than
constants (``inline_inbuilt_nn_modules``), so the second and later blocks pass the first one's guards and
reuse its graph, its AOT-autograd forward / backward and its inductor kernels (torch 2.13 always inlines
built-in modules this way; its ``inline_inbuilt_nn_modules`` switch is deprecated and ignored). Cold
compile time is thus
that of one block (plus one per distinct kind, e.g. checkpointed and plain blocks under selective
every-Nth checkpointing), whatever the depth. Compilation is lazy: the cost lands in the first forward /
backward, which `compile_seconds()` reports, and `compile_label()` says whether it was cold or served
by inductor's on-disk FX graph cache ($TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER): a
second run of the same shapes still traces but loads the compiled kernels.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan_lite.protocols.model_spec import ParallelPlan
from torchtitan_lite.protocols.module_names import named_submodules

logger = logging.getLogger(__name__)


def apply_compile(blocks: torch.nn.ModuleDict, *, backend: str, fullgraph: bool,
                  regions: tuple[str, ...] | Callable[[torch.nn.Module], tuple[str, ...]] = ()) -> int:
    """Compile every block of ``blocks`` (the model's ParallelPlan.blocks container) in place (``Module.compile``,
    so parameter names are unchanged).

    Whether to compile at all is the caller's: ``ResolvedRun.compile_model`` decides it once, and only a run
    that compiles its blocks calls this. backend / fullgraph: torch.compile's, as in compile.backend and
    compile.fullgraph.
    regions: compile these block-relative submodules of each block instead of the whole block, leaving the
    code between them eager (where a block runs something a graph cannot hold, e.g. the host-side split
    sizes of an expert-parallel all-to-all); or a function of the block giving its regions, for a family
    whose blocks differ (an empty tuple compiles that block whole). Returns the number of compiled blocks.
    """
    for block in blocks.values():
        block_regions = regions(block) if callable(regions) else regions
        for module in _regions(block, block_regions) if block_regions else [block]:
            module.compile(backend=backend, fullgraph=fullgraph)
    logger.info("compiling %d blocks with backend=%s fullgraph=%s, once per block kind (first step pays the "
                "compile time)", len(blocks), backend, fullgraph)
    return len(blocks)


def expert_parallel_regions(plan: ParallelPlan) -> Callable[[torch.nn.Module], tuple[str, ...]]:
    """The compile regions of a block under expert parallelism: ``plan.ep_compile_regions`` for a block that holds
    the plan's experts, () (the whole block) for one that does not (a dense block of an MoE family)."""
    def regions(block: torch.nn.Module) -> tuple[str, ...]:
        return plan.ep_compile_regions if plan.experts in named_submodules(block) else ()
    return regions


def _regions(block: torch.nn.Module, regions: tuple[str, ...]) -> list[torch.nn.Module]:
    """The block's submodules named in ``regions``, looked up through an activation-checkpoint wrapper."""
    by_name = named_submodules(block)
    missing = [r for r in regions if r not in by_name]
    if missing:
        raise ValueError(f"compile regions {missing} are not submodules of {type(block).__name__}")
    return [by_name[r] for r in regions]


def maybe_compile_loss(loss_fn: Callable, *, enabled: bool, backend: str) -> Callable:
    """`loss_fn` compiled with `backend` when `enabled`, else unchanged."""
    if not enabled:
        return loss_fn
    return torch.compile(loss_fn, backend=backend)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo + backend, forward and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compiled_graphs() -> int:
    """Distinct graphs dynamo has compiled in this process so far (a block kind, the loss, each recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(frozen=True)
class CompileStats:
    seconds: float
    graphs: int
    cache_hits: int
    """Forward / backward graphs whose kernels inductor loaded from its FX graph cache."""
    cache_misses: int
    """Forward / backward graphs inductor generated and compiled C++ / Triton code for (missed, or not cacheable)."""
    autotuned: int = 0
    """Autotuning results in Triton's on-disk cache (compile_cache.py): a rise over a step is kernels it tuned."""


def compile_stats() -> CompileStats:
    """What this process has compiled so far, and how much of it came from inductor's on-disk cache.

    Only inductor's FX graph cache decides: the C++ / Triton compilation it saves is the expensive part.
    The AOT-autograd cache in front of it is often bypassed (torch 2.13 bypasses it for our blocks), which
    costs a re-trace but no compilation."""
    from torch._dynamo.utils import counters

    from torchtitan_lite.compile_cache import autotuned_kernels

    inductor = counters["inductor"]
    return CompileStats(seconds=compile_seconds(), graphs=compiled_graphs(),
                        cache_hits=int(inductor["fxgraph_cache_hit"]),
                        cache_misses=int(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"]),
                        autotuned=autotuned_kernels())


def compile_label(stats: CompileStats) -> str:
    """'12.3s cold compile of 2 graph(s) ...', or what inductor's cache served: a warm run still traces
    (dynamo, AOT autograd) and loads the kernels, so its seconds are not a compile's."""
    what = f"compile of {stats.graphs} graph(s)"
    if stats.cache_hits and not stats.cache_misses:
        return f"{stats.seconds:.1f}s cached {what} (every kernel from inductor's cache: traced again, not compiled)"
    if stats.cache_hits:
        lookups = stats.cache_hits + stats.cache_misses
        return (f"{stats.seconds:.1f}s partly cached {what} ({stats.cache_hits} of {lookups} forward / backward "
                f"graphs from inductor's cache)")
    if stats.cache_misses:
        return f"{stats.seconds:.1f}s cold {what} (nothing in inductor's cache)"
    return f"{stats.seconds:.1f}s {what} (no inductor cache involved)"


def first_step_compile_label(before: CompileStats, after: CompileStats, *, step_s: float) -> str:
    """The first step's share of the compile: what was compiled between ``before`` (read as the step starts) and
    ``after`` (as it ends), named apart from what was compiled before the step (the step-0 validation's forward).

    The counters are cumulative over the process, so reading them once at the step's end charged the step with
    every earlier compile. Their seconds are torch's sums of its compile phases, not a wall clock: a step's share
    is bounded by the step's own ``step_s``, which it cannot exceed."""
    inside = CompileStats(seconds=min(max(after.seconds - before.seconds, 0.0), step_s),
                          graphs=after.graphs - before.graphs, cache_hits=after.cache_hits - before.cache_hits,
                          cache_misses=after.cache_misses - before.cache_misses)
    text = compile_label(inside)
    if before.graphs:
        text += f"; {before.seconds:.1f}s compiling {before.graphs} graph(s) before the step"
    tuned = after.autotuned - before.autotuned
    if tuned:
        text += f"; Triton autotuned {tuned} kernel(s) (kept in $TRITON_CACHE_DIR: the next run reuses them)"
    elif after.autotuned:
        text += f"; no Triton autotuning ({after.autotuned} result(s) reused from $TRITON_CACHE_DIR)"
    return text
