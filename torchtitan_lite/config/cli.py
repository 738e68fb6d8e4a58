"""Command line -> resolved config and the action to run.

    train.py [--config NAME] [--config-file FILE.toml] [--section.field VALUE ...] [ACTION]

Settings are layered: the registered config function < the TOML file < ``--section.field`` flags.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_lite.config.docs import fields_help_text
from torchtitan_lite.config.errors import ConfigError, closest, did_you_mean
from torchtitan_lite.config.overrides import Override, apply_overrides, overrides_from_dict
from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.config.toml_io import load_toml_overrides

DEFAULT_CONFIG = "llama3_debug"
HELP_FLAGS = ("-h", "--help")
VALUE_FLAGS = {
    "--config": ("NAME", f"registered config to start from (default: {DEFAULT_CONFIG}); see --list-configs"),
    "--config-file": ("FILE", "TOML file of overrides applied on top of it, e.g. a run's saved config.toml"),
    "--nnodes": ("N", "nodes of the launch that --check-config / --estimate-memory / --dry-run size: world size = "
                      "NGPU (or NPROC) x N (default 1)"),
}
ACTION_FLAGS = {
    "--list-configs": ("list_configs", "list the registered configs and exit"),
    "--print-config": ("print_config", "print the resolved config as TOML (loadable with --config-file) and exit"),
    "--print-fp8-plan": ("print_fp8_plan", "explain which Linear layers get which float8 recipe, and why; exit"),
    "--estimate-memory": ("estimate_memory", "estimate per-device memory for the resolved config and exit"),
    "--check-config": ("check_config", "apply every rule the build applies (degrees, precision, converters, plan) "
                                       "for the launch (WORLD_SIZE, or NGPU / NPROC x --nnodes) and check its data, "
                                       "then exit: 0 ready, 1 valid but a launch would stop, 2 invalid"),
    "--dry-run": ("dry_run", "build and parallelize rank 0 of NGPU (x --nnodes) ranks on meta over a fake process "
                             "group; print per-rank bytes, the fp8 plan's summary and the memory estimate; exit"),
    "--dry-run-detail": ("dry_run_detail", "--dry-run with the fp8 plan's tables (a row per Linear and expert "
                                           "weight) in place of its summary; exit"),
}
ACTIONS = ("train", "help", *(action for action, _ in ACTION_FLAGS.values()))


@dataclasses.dataclass(frozen=True)
class CliResult:
    """What the command line asks for."""

    config: Any
    """The resolved root config; None for the actions that need none (help, list_configs)."""
    action: str
    """One of ACTIONS: train, help, print_config, list_configs, print_fp8_plan, estimate_memory."""
    config_name: str
    """The registered config the resolved config starts from."""
    nnodes: int = 1
    """Nodes of the launch the inspecting actions size (--nnodes)."""
    help_config: str | None = None
    """With --help: the --config NAME given beside it, whose values the field listing shows."""


@dataclasses.dataclass
class _Argv:
    config: str | None = None
    config_file: str | None = None
    nnodes: str | None = None
    actions: list[str] = dataclasses.field(default_factory=list)
    overrides: list[Override] = dataclasses.field(default_factory=list)


def parse_cli(argv: list[str], *, registry: ConfigRegistry, default_config: str = DEFAULT_CONFIG) -> CliResult:
    """Resolve ``argv`` (without the program name) into a config from ``registry`` and an action.

    Raises ConfigError for anything the user must fix; its message is meant to be printed as is.
    """
    if any(arg in HELP_FLAGS for arg in argv):
        # Help must work even when the rest is wrong; only a --config NAME is picked up.
        return CliResult(None, "help", default_config, help_config=_config_name(argv))
    args = _split_argv(argv)
    name = args.config or default_config
    action = _single_action(args.actions)
    if action == "list_configs":
        return CliResult(None, action, name)
    overrides = []
    if args.config_file is not None:
        overrides += overrides_from_dict(load_toml_overrides(args.config_file), origin=args.config_file)
    config = apply_overrides(registry.get(name), overrides + args.overrides, base_label=f"config '{name}'")
    return CliResult(config, action, name, nnodes=_nnodes(args.nnodes))


def _config_name(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.partition("=")[2]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _nnodes(value: str | None) -> int:
    if value is None:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--nnodes expects a positive integer, got {value!r}")
    return int(value)


def main_help_text(root_cls: type, config: Any = None, config_name: str | None = None) -> str:
    """``--help`` text: usage, the command-line flags, then every config field with type, default and doc
    (and, with ``config``, its value in that registered config where it differs)."""
    flags = [("-h, --help", "show this help and exit")]
    flags += [(f"{flag} {metavar}", doc) for flag, (metavar, doc) in VALUE_FLAGS.items()]
    flags += [(flag, doc) for flag, (_, doc) in ACTION_FLAGS.items()]
    width = max(len(flag) for flag, _ in flags)
    return "\n".join([
        "usage: train.py [--config NAME] [--config-file FILE] [--section.field VALUE ...] [ACTION]",
        "",
        f"Settings are layered: the registered config (--config, default {DEFAULT_CONFIG}) < the TOML file of",
        "--config-file < --section.field flags (also --section.field=VALUE).",
        "Values: bools true/false/yes/no/1/0 (a bare bool flag means true); none or null for optional fields;",
        "lists a,b or [a, b] ('' is empty); typed lists take kind names and their entries' fields by index",
        "(--model_converters.converters float8 --model_converters.converters.0.recipe_name rowwise).",
        "",
        "options:",
        *(f"  {flag.ljust(width)}  {doc}" for flag, doc in flags),
        "",
        "config fields:" if config is None else
        f"config fields (with the value in config '{config_name}' where it differs from the default):",
        fields_help_text(root_cls, config, config_name or "config"),
    ])


def list_configs_text(registry: ConfigRegistry) -> str:
    """``name  first docstring sentence`` for every registered config, one per line."""
    entries = registry.describe()
    warnings = [f"warning: {broken.summary()}" for broken in registry.broken_modules()]
    if not entries:
        return "\n".join(["no configs are registered", *warnings])
    width = max(len(name) for name, _ in entries)
    return "\n".join([*(f"{name.ljust(width)}  {doc}".rstrip() for name, doc in entries), *warnings])


def _split_argv(argv: list[str]) -> _Argv:
    parsed = _Argv()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: values follow their flag, as in "
                              f"--training.steps 10 (see --help)")
        flag, eq, inline = token.partition("=")
        value = inline if eq else None
        takes_value = flag in VALUE_FLAGS or "." in flag
        if value is None and takes_value and i < len(argv) and not argv[i].startswith("--"):
            value = argv[i]
            i += 1
        _record(parsed, flag, value)
    return parsed


def _record(parsed: _Argv, flag: str, value: str | None) -> None:
    if flag in ACTION_FLAGS:
        if value is not None:
            raise ConfigError(f"{flag} takes no value, got {value!r}")
        parsed.actions.append(ACTION_FLAGS[flag][0])
    elif flag in VALUE_FLAGS:
        metavar = VALUE_FLAGS[flag][0]
        if value is None:
            raise ConfigError(f"{flag} needs a value: {flag} {metavar}")
        attr = flag[2:].replace("-", "_")
        if getattr(parsed, attr) is not None:
            raise ConfigError(f"{flag} is given twice ({getattr(parsed, attr)!r} and {value!r}); give it once")
        setattr(parsed, attr, value)
    elif "." in flag:
        key = flag[2:]
        if "" in key.split("."):
            raise ConfigError(f"malformed flag '{flag}': expected --section.field")
        parsed.overrides.append(Override(key, value))
    else:
        known = ["--help", *VALUE_FLAGS, *ACTION_FLAGS]
        raise ConfigError(f"unknown flag '{flag}'{did_you_mean(closest(flag, known))}; valid flags: "
                          f"{', '.join(known)}, and --section.field VALUE to set a config field (see --help)")


def _single_action(actions: list[str]) -> str:
    distinct = list(dict.fromkeys(actions))
    if len(distinct) > 1:
        flags = [flag for flag, (action, _) in ACTION_FLAGS.items() if action in distinct]
        raise ConfigError(f"choose one action, got {' and '.join(flags)}")
    return distinct[0] if distinct else "train"
