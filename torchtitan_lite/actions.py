"""Command-line actions that inspect a config instead of training with it."""
from __future__ import annotations

import os
import sys

import torch


def run_action(cli) -> int:
    """Print the action's text; a ValueError (bad degrees, flavor, ...) is a config error: exit 2."""
    try:
        text = _ACTIONS[cli.action](cli)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _help(cli) -> str:
    from torchtitan_lite.config import main_help_text
    from torchtitan_lite.trainer import Trainer

    return main_help_text(Trainer.Config)


def _list_configs(cli) -> str:
    from torchtitan_lite.config import list_configs_text

    return list_configs_text()


def _print_config(cli) -> str:
    from torchtitan_lite.config import config_to_toml

    return f"# resolved config: {cli.config_name}\n" + config_to_toml(cli.config)


def _print_fp8_plan(cli) -> str:
    """Build the model on meta and explain which Linear gets which float8 recipe, and why."""
    from models import build_model_args, get_model_spec
    from torchtitan_lite.components.quantization.float8 import Float8LinearConverter

    cfg = cli.config
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers)
    with torch.device("meta"):
        model = spec.model_cls(args)
    float8 = [c for c in cfg.model_converters.converters if isinstance(c, Float8LinearConverter.Config)]
    if not float8:
        return (f"config '{cli.config_name}' has no float8 converter: every Linear runs in "
                f"{cfg.precision.param_dtype}. Add one with --model_converters.converters float8")
    converter = float8[0].build(parallel_dims=_parallel_dims(cfg), config=cfg)
    return converter.explain(model, seq_len=cfg.training.seq_len,
                             total_flops_per_token=model.flops_per_token(cfg.training.seq_len))


def _parallel_dims(cfg):
    """The layout the config would get at launch; world size from WORLD_SIZE, NGPU or NPROC."""
    from torchtitan_lite.distributed.parallel_dims import ParallelDims

    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("NGPU") or os.environ.get("NPROC") or 1)
    return ParallelDims(dp_replicate=cfg.parallelism.dp_replicate, dp_shard=cfg.parallelism.dp_shard,
                        tp=cfg.parallelism.tp, world_size=world_size)


def _check_config(cli) -> str:
    """What run_train.sh runs before torchrun, so bad degrees fail before any process starts."""
    from models import build_model_args, get_model_spec

    cfg = cli.config
    dims = _parallel_dims(cfg)
    world_size = dims.world_size
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers)
    dims.validate_for_model(args, cfg.training.seq_len, sequence_parallel=cfg.parallelism.enable_sequence_parallel)
    return f"config '{cli.config_name}' is valid for {world_size} process(es)"


def _estimate_memory(cli) -> str:
    from torchtitan_lite.memory_estimate import estimate_memory_text

    return estimate_memory_text(cli.config)


_ACTIONS = {
    "help": _help,
    "list_configs": _list_configs,
    "print_config": _print_config,
    "print_fp8_plan": _print_fp8_plan,
    "estimate_memory": _estimate_memory,
    "check_config": _check_config,
}
