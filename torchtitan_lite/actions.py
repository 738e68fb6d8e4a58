"""Command-line actions that inspect a config instead of training with it.

Each one resolves the run exactly as the trainer would (``resolve_run``) for the launch described by the
environment: WORLD_SIZE, or NGPU / NPROC as run_train.sh uses them, and CUDA when NGPU is set.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from torchtitan_lite.components.quantization import expert_quantizer, linear_quantizer, low_precision_plan
from torchtitan_lite.config import CliResult, ConfigError, list_configs_text, main_help_text
from torchtitan_lite.distributed.tensor_parallel import tp_communication_text
from torchtitan_lite.launch_check import check_devices, check_memory, check_resume, unchecked_here
from torchtitan_lite.memory.estimate import GIB
from torchtitan_lite.mesh import process_groups as dist_utils
from torchtitan_lite.protocols.model_size import expert_layout_text
from torchtitan_lite.resolved_run import ResolvedRun, resolve_run

PREFLIGHT_ENV = "TORCHTITAN_LITE_PREFLIGHT"
"""Set by run_train.sh for the check it runs right before torchrun: the devices and the data must then be present."""
REQUIRE_DATA_ENV = "TORCHTITAN_LITE_REQUIRE_DATA"
"""Set by scripts/slurm_multinode.sh for its check on the submitting host: the data must be present (the
GPUs are on the compute nodes)."""

if TYPE_CHECKING:
    from torchtitan_lite.config.registry import ConfigRegistry
    from torchtitan_lite.trainer import Trainer


class LaunchWouldStop(Exception):
    """The config is valid, but a training launch would stop (its data or tokenizer is not ready): exit 1."""


def run_action(cli: CliResult, *, registry: ConfigRegistry) -> int:
    """Print the action's text; a ValueError (bad degrees, flavor, combination, ...) is a config error:
    exit 2; a valid config that a launch could not train with (LaunchWouldStop) exits 1."""
    try:
        text = _ACTIONS[cli.action](cli, registry)
    except LaunchWouldStop as stop:
        print(stop)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def launch_run(config: Trainer.Config, *, nnodes: int = 1) -> ResolvedRun:
    """The run a launch from this environment (of ``nnodes`` such nodes) would resolve."""
    return resolve_run(config, world_size=dist_utils.launch_world_size() * nnodes,
                       device_type=dist_utils.launch_device_type())


def _help(cli: CliResult, registry: ConfigRegistry) -> str:
    from torchtitan_lite.trainer import Trainer

    if cli.help_config is None:
        return main_help_text(Trainer.Config)
    try:
        config = registry.get(cli.help_config)
    except ConfigError as e:
        return f"{main_help_text(Trainer.Config)}\n\n(--config {cli.help_config}: {e})"
    return main_help_text(Trainer.Config, config, cli.help_config)


def _list_configs(cli: CliResult, registry: ConfigRegistry) -> str:
    return list_configs_text(registry)


def _print_config(cli: CliResult, registry: ConfigRegistry) -> str:
    from torchtitan_lite.config import config_to_toml

    return f"# resolved config: {cli.config_name}\n" + config_to_toml(cli.config)


def _print_fp8_plan(cli: CliResult, registry: ConfigRegistry) -> str:
    """Build the model on meta and explain which Linear gets which FP8 recipe (float8 or MX), and why."""
    run = launch_run(cli.config, nnodes=cli.nnodes)
    converters = run.converters.converters
    if linear_quantizer(converters) is None and expert_quantizer(converters) is None:
        return (f"config '{cli.config_name}' has no FP8 converter: every Linear runs in "
                f"{cli.config.precision.param_dtype}. Add one with --model_converters.converters float8 (or mx; "
                f"moe_experts for the routed experts of an MoE model)")
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    run.converters.check_tp_shards(model)  # every converter's misfits in one error, before any plan table
    text = low_precision_plan(converters, model, seq_len=run.seq_len,
                              total_flops_per_token=model.flops_per_token(run.seq_len)) or ""
    if not run.parallel_dims.tp_enabled:
        return text
    # What TP moves depends on which Linears were converted: convert a meta copy and read the regions.
    with _quiet():
        run.converters.convert(model)
    return text + "\n" + tp_communication_text(run.model_spec.parallel_plan, model, tp=run.parallel_dims.tp,
                                               high_precision=run.precision.param_dtype)


def _check_config(cli: CliResult, registry: ConfigRegistry) -> str:
    """What run_train.sh runs before torchrun: every rule the build would apply, before any process starts.

    Everything that can be built on meta is (run resolution, converters); then the devices and the memory
    estimate are held against the host (GPU memory per rank, or host RAM shared by the CPU processes), and
    what this host cannot show (GPUs it lacks) is named. Last, the tokenizer and the data: missing or
    unreachable sources, options the source has no use for, a validation split it lacks and bad local
    records. Any of them is an error right before a launch (exit 2); otherwise they are listed after the
    verdict and the exit status is 1, since a launch would stop.
    """
    from torchtitan_lite.components.data import prescan
    from torchtitan_lite.components.data.readiness import data_problems, not_ready_text, scan_local_records

    run = launch_run(cli.config, nnodes=cli.nnodes)
    with torch.device("meta"), _quiet():
        run.converters.convert(run.model_spec.model_cls(run.model_args))
    preflight = os.environ.get(PREFLIGHT_ENV) == "1"
    ngpu = dist_utils.requested_gpus()
    check_devices(ngpu=ngpu, preflight=preflight)
    estimate = check_memory(run, processes_on_host=dist_utils.launch_world_size())
    cfg = cli.config
    notes, warnings = check_resume(cfg, run)
    resume = [f"note: {n}" for n in notes] + [f"warning: {w}" for w in warnings]
    if preflight and resume:  # run_train.sh discards this check's stdout: what the resume changes goes to stderr
        print("\n".join(resume), file=sys.stderr)
    problems = data_problems(cfg.data, cfg.tokenizer, validation=cfg.validation.enable)
    record_problems, clean = scan_local_records(cfg.data, validation=cfg.validation.enable)
    problems += [p for p in record_problems if p not in problems]
    if problems and (preflight or os.environ.get(REQUIRE_DATA_ENV) == "1"):
        raise ValueError(not_ready_text(problems))
    prescan.hand_over(clean)
    verdict = (f"config '{cli.config_name}' is valid for {run.world_size} process(es) ({run.parallel_dims.describe()}); "
               f"estimated peak {estimate.total / GIB:.1f} GiB per rank")
    if run.moe_facts is not None:
        dims = run.parallel_dims
        verdict += (f"\nmodel: {estimate.model}\n" + expert_layout_text(
            run.moe_facts, n_layers=run.model_args.n_layers, ep=dims.ep, dp_shard=dims.dp_shard, fsdp=dims.fsdp_enabled,
            tp=dims.tp, cp=dims.cp))
    if run.pipeline is not None:
        # Two different numbers: micro-batches flow through the stages, accumulation repeats the pipeline step.
        verdict += (f"\npipeline: {run.pipeline.summary()}; gradient accumulation {run.n_microbatches} "
                    f"(local batches per optimizer step)")
    verdict = "\n".join([verdict, *resume])
    unchecked = unchecked_here(run, ngpu=ngpu, preflight=preflight)
    if unchecked:
        verdict += "\nnot checked on this host:" + "".join(f"\n  - {note}" for note in unchecked)
    if problems:
        raise LaunchWouldStop(f"{verdict}\nbut a training launch would stop: {not_ready_text(problems)}")
    return verdict


def _dry_run(cli: CliResult, registry: ConfigRegistry) -> str:
    from torchtitan_lite.dry_run import dry_run_text

    return dry_run_text(launch_run(cli.config, nnodes=cli.nnodes), cli.config.precision,
                        detail=cli.action == "dry_run_detail")


def _estimate_memory(cli: CliResult, registry: ConfigRegistry) -> str:
    from torchtitan_lite.memory.estimate import estimate_memory_text

    return estimate_memory_text(launch_run(cli.config, nnodes=cli.nnodes))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No INFO logs (a converter logs its whole plan when it converts): the action prints what it means to."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


_ACTIONS: dict[str, Callable[[CliResult, ConfigRegistry], str]] = {
    "help": _help,
    "list_configs": _list_configs,
    "print_config": _print_config,
    "print_fp8_plan": _print_fp8_plan,
    "estimate_memory": _estimate_memory,
    "check_config": _check_config,
    "dry_run": _dry_run,
    "dry_run_detail": _dry_run,
}
