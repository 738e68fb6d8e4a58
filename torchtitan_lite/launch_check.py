"""Does the launch fit the host? Devices and memory, checked before torchrun starts any process.

``--check-config`` (which run_train.sh runs before every launch) resolves the run and then asks two
questions the build itself would only answer by crashing: are the requested GPUs there, and does the
estimated per-rank peak fit the memory each rank will have (GPU memory, or host RAM shared by the CPU
processes of one node)? And, for a run that resumes, whether the checkpoint holds the run's model (its
recorded config.toml) and what the resume changes in how data is fed, read from the checkpoint's marker.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from torchtitan_lite.components.checkpoint.layout import Marker, check_same_top_k, scan_steps, step_dir
from torchtitan_lite.components.checkpoint.manager import initial_weights_passed_over
from torchtitan_lite.components.checkpoint.seed_warning import seed_over_later_run
from torchtitan_lite.components.checkpoint.written_model import WrittenModel, check_same_model, written_model
from torchtitan_lite.components.data.layout import DataLayout, resume_changes
from torchtitan_lite.memory.estimate import GIB, MemoryEstimate, estimate_run_memory
from torchtitan_lite.resolved_run import ResolvedRun
from torchtitan_lite.train_state import check_steps_ahead

if TYPE_CHECKING:
    from torchtitan_lite.trainer import Trainer

ASSUMED_GPU_MEMORY_GIB = 80.0
"""GPU memory assumed when the launch is sized from a host without the GPUs (an H100 SXM has 80 GiB)."""
GPU_MEMORY_ENV = "TTL_GPU_MEMORY_GIB"


def check_devices(*, ngpu: int | None, preflight: bool) -> None:
    """Before a launch (``preflight``), ``NGPU`` GPU processes need that many CUDA devices on this host. A
    login node without GPUs may still size the job: --check-config / --estimate-memory / --dry-run."""
    if ngpu is None or not preflight:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        raise ValueError(
            f"NGPU={ngpu} but this host has no CUDA device, so torchrun would start {ngpu} CPU processes that each "
            f"build the whole model. Use NPROC={ngpu} for CPU processes (gloo), or check the {ngpu}-GPU layout "
            f"here with --dry-run (add --nnodes N for N nodes)"
        )
    if available < ngpu:
        raise ValueError(f"NGPU={ngpu} but this host has {available} CUDA device(s); launch at most {available} "
                         f"processes per node")


def unchecked_here(run: ResolvedRun, *, ngpu: int | None, preflight: bool) -> list[str]:
    """What a launch needs that this host cannot show: sizing a GPU job from a host without its GPUs checks
    neither that the devices exist nor how much memory they have."""
    notes = []
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu is not None and not preflight and available < ngpu:
        notes.append(f"the devices: NGPU={ngpu} needs {ngpu} CUDA device(s) per node; this host has "
                     f"{available or 'none'}")
    if run.device_type == "cuda" and available == 0:
        _, source = memory_limit(run, processes_on_host=1)
        notes.append(f"the GPU memory: the estimate was held against {source}")
    return notes


def memory_limit(run: ResolvedRun, *, processes_on_host: int) -> tuple[int, str]:
    """Bytes one rank may use, and where that figure comes from."""
    if run.device_type == "cuda":
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return props.total_memory, f"{props.name} memory"
        if GPU_MEMORY_ENV in os.environ:
            gib = float(os.environ[GPU_MEMORY_ENV])
            return int(gib * GIB), f"{gib:g} GiB per GPU (from {GPU_MEMORY_ENV}: this host has no GPU to ask)"
        gib = ASSUMED_GPU_MEMORY_GIB
        return int(gib * GIB), (f"{gib:g} GiB per GPU (assumed: this host has no GPU to ask; set "
                                f"{GPU_MEMORY_ENV} for other GPUs)")
    total = _host_memory_bytes()
    share = total // max(1, processes_on_host)
    return share, f"host RAM {total / GIB:.1f} GiB shared by {processes_on_host} CPU process(es)"


def check_memory(run: ResolvedRun, *, processes_on_host: int) -> MemoryEstimate:
    """The estimate of ``run``; an error naming estimate, limit and the cheapest fixes when it does not fit."""
    estimate = estimate_run_memory(run)
    limit, source = memory_limit(run, processes_on_host=processes_on_host)
    if estimate.total <= limit:
        return estimate
    raise ValueError(
        f"estimated peak per rank {estimate.total / GIB:.1f} GiB ({run.parallel_dims.describe()}, world size "
        f"{run.world_size}) exceeds {limit / GIB:.1f} GiB ({source}). Cheapest fixes: "
        + "; ".join(_fixes(run)) + ". See --estimate-memory for the breakdown"
    )


def check_resume(config: Trainer.Config, run: ResolvedRun) -> tuple[list[str], list[str]]:
    """(notes, warnings) about the checkpoint a launch would resume from (the newest complete one, or
    checkpoint.load_step), from its recorded config and marker alone; a ValueError when it holds another
    model (check_resumed_model) or its data position cannot continue."""
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint:
        warning = seed_over_later_run(config.job.dump_folder, config.checkpoint.folder)
        return [], [] if warning is None else [warning]
    resumed = resume_step(config)
    if resumed is None:
        return [], []
    written = check_resumed_model(config, run)
    folder, step = resumed
    check_steps_ahead(step, config.training.steps, folder)
    passed_over = [] if ckpt.initial_load_path is None else [
        initial_weights_passed_over(ckpt.initial_load_path, folder, step)]
    marker = Marker.read(step_dir(folder, step))
    if marker is not None:
        check_same_top_k(marker.moe_top_k, None if run.moe_facts is None else run.moe_facts.top_k,
                         step_dir(folder, step))
    if marker is None or marker.model_only:
        return [], passed_over
    try:
        notes, warnings = resume_changes(
            DataLayout.from_record(marker.data_layout), run.data_layout(config.data), step=step,
            data_loaded="dataloader" in marker.states and "dataloader" not in ckpt.exclude_from_loading,
            global_batch_set=config.training.global_batch_size > 0)
    except ValueError as e:
        if written is None:
            raise
        # The same model, other data: whose run the folder holds is half of the choice between its fixes.
        raise ValueError(f"job.dump_folder={config.job.dump_folder} holds a {written.family} flavor "
                         f"{written.flavor!r} run; {e}") from None
    return notes, passed_over + warnings


def resume_step(config: Trainer.Config) -> tuple[str, int] | None:
    """(checkpoint folder, step) a launch would resume from: the newest complete checkpoint, or
    checkpoint.load_step; None when there is none (or a load_step the manager reports)."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return None
    folder = os.path.join(config.job.dump_folder, ckpt.folder)
    complete, _ = scan_steps(folder)
    step = ckpt.load_step if ckpt.load_step >= 0 else complete[-1] if complete else None
    return None if step is None or step not in complete else (folder, step)


def check_resumed_model(config: Trainer.Config, run: ResolvedRun) -> WrittenModel | None:
    """A ValueError, before anything is built, when the checkpoint the run would resume holds another model
    (family, flavor, n_layers or vocabulary) than the run's: it names both, and the fix is another folder.
    Otherwise the model the checkpoint records, None when it records none or the run resumes nothing."""
    resumed = resume_step(config)
    if resumed is None:
        return None
    folder, step = resumed
    written = written_model(step_dir(folder, step))
    if written is None or {"model", "optimizer"} <= set(config.checkpoint.exclude_from_loading):
        return written
    tokenizer_path = config.tokenizer.path
    check_same_model(written, config.model, run.model_args, step=step, dump_folder=config.job.dump_folder,
                     vocab_known=tokenizer_path is None or os.path.exists(os.path.expanduser(tokenizer_path)))
    return written


def _fixes(run: ResolvedRun) -> list[str]:
    fixes = [f"more GPUs / processes (FSDP shards parameters, gradients and optimizer states over them: "
             f"NGPU x --nnodes > {run.world_size})"]
    dims, facts = run.parallel_dims, run.moe_facts
    # Up to 8 EP ranks: one node of 8 GPUs keeps the token all-to-all on its fast links.
    ep = min(8, math.gcd(facts.num_experts, dims.dp_shard)) if facts is not None and dims.ep == 1 else 1
    if facts is not None and ep > 1:
        fixes.append(f"--parallelism.ep {ep} (expert parallelism: FSDP gathers and reduce-scatters 1/{ep} of each "
                     f"block's experts; {ep} divides num_experts={facts.num_experts} and dp_shard={dims.dp_shard})")
    if run.ac_mode != "full":
        fixes.append("--activation_checkpoint.mode full (recompute activations in backward)")
    if run.local_batch_size > 1:
        fixes.append(f"a smaller --training.local_batch_size (now {run.local_batch_size}; keep the global "
                     f"batch with --training.global_batch_size)")
    if run.optimizer_low_bit is None:
        fixes.append("--optimizer.low_bit adamw8bit (8-bit AdamW states: a quarter of the fp32 bytes)")
    return fixes


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
