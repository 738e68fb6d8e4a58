"""Train the same model with upstream torchtitan and with torchtitan_lite on this machine; print both
trainers' steady tokens/s and their ratio.

    python scripts/torchtitan_side_by_side.py                        # llama3_debug, 30 steps, first 10 excluded
    python scripts/torchtitan_side_by_side.py --steps 60 --warmup 20 --log-freq 10 --repeats 2 \\
        --out-md BENCHMARKS.md --append

1. Environment: torchtitan is installed from the package registry into its own virtual environment
   (``--venv``, default ``.cache/torchtitan_venv``, git-ignored) next to the same torch version as
   ours (a pinned CPU wheel where that is what we run, so no CUDA build is pulled in) and triton,
   which torchtitan 0.3.0 imports at start-up without declaring it. Nothing of torchtitan is vendored.
2. Data: torchtitan reads the same documents (our embedded corpus's training shards, linked into
   the run folder and opened by its ``c4_test`` JSON loader through ``dataloader.dataset_path``). Its
   wheel ships no tokenizer, so a byte-level BPE with our tokenizer's vocabulary size is trained on
   the same shards with the ``tokenizers`` package. Token ids differ; tokens per step do not.
3. Config: torchtitan 0.3.0 is configured by Python config functions plus command-line flags, so
   ``<run>/ttl_side_by_side_config.py`` is generated with our resolved model arguments (dim, layers,
   heads, KV heads, vocabulary, FFN width, RoPE, norm eps), sequence length, batch, optimizer and LR
   schedule, clipping, GC interval, float32, no compile, no activation checkpointing, no validation,
   no checkpoints; steps and the log interval are passed as flags. Attention is torchtitan's own
   causal ``ScaledDotProductAttention`` (its default FlexAttention has no CPU backward), the same
   kernel our model calls.
4. Run: torchtitan under torchrun with the CPU shims of scripts/_torchtitan_cpu.py (which says
   exactly what fails without them), then ``train.py`` with the matching flags. Each trainer's own
   console throughput is parsed (torchtitan ``tps``, ours ``tok/s``; both count input tokens per
   device over the interval since the previous log line), and the logs after ``--warmup`` steps are
   combined into tokens / time. ``--repeats`` interleaves the runs and keeps each trainer's fastest.

The model's parameter count is parsed from both logs and must agree, or the comparison stops.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.tools.benchmark.report import write_markdown
from torchtitan_lite.tools.benchmark.run_info import cpu_description, git_commit, load_average
from torchtitan_lite.tools.repo import REPO_ROOT, SCRIPTS_DIR
from torchtitan_lite.tools.torchtitan_side_by_side.environment import ensure_tokenizer, ensure_venv, link_training_shards
from torchtitan_lite.tools.torchtitan_side_by_side.logs import (
    OURS_PARAMS,
    OURS_STEP,
    TORCHTITAN_PARAMS,
    TORCHTITAN_STEP,
    parse_params,
    parse_throughput,
    run_logged,
    steady_tokens_per_s,
)
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import (
    CONFIG_FUNCTION,
    CONFIG_MODULE,
    Settings,
    torchtitan_config_source,
)

DEFAULT_TORCHTITAN = "0.3.0"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other --section.field VALUE flags override our config; the torchtitan side follows them where "
               "the settings above cover them, and the run stops if they need anything else.")
    parser.add_argument("--config", default="llama3_debug", help="our registry config (default llama3_debug)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps excluded (default 10)")
    parser.add_argument("--log-freq", type=int, default=10, help="both trainers' log interval (default 10)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs per trainer, fastest kept")
    parser.add_argument("--torchtitan-version", default=DEFAULT_TORCHTITAN, help=f"default {DEFAULT_TORCHTITAN}")
    parser.add_argument("--venv", type=Path, default=REPO_ROOT / ".cache" / "torchtitan_venv",
                        help="torchtitan's virtual environment, created when missing")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".cache" / "torchtitan_side_by_side",
                        help="generated config, tokenizer, data links and logs")
    parser.add_argument("--torchtitan-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag for torchtitan, repeatable, e.g. "
                             "--torchtitan-arg=--debug.no-enable_structured_logging")
    parser.add_argument("--out-md", type=Path, help="write a markdown section with the result here")
    parser.add_argument("--append", action="store_true", help="append to --out-md instead of overwriting it")
    args, overrides = parser.parse_known_args(argv)
    if args.log_freq < 1 or args.warmup < 1 or args.steps <= args.warmup:
        parser.error("need --log-freq >= 1, --warmup >= 1 and --steps > --warmup")
    if args.warmup % args.log_freq or args.steps % args.log_freq:
        parser.error(f"--warmup ({args.warmup}) and --steps ({args.steps}) must be multiples of --log-freq "
                     f"({args.log_freq}): throughput is read from whole log intervals")
    if args.append and args.out_md is None:
        parser.error("--append needs --out-md")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args, overrides


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Run both trainers on the config ``argv`` names (from ``registry``) and print the comparison."""
    args, overrides = parse_args(argv)
    config, settings, tokenizer_path = resolve(args.config, overrides, registry)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    venv_python, versions = ensure_venv(args.venv, args.torchtitan_version)
    data_dir = link_training_shards(args.run_dir / "data")
    tokenizer_dir = ensure_tokenizer(venv_python, args.run_dir / "tokenizer", settings.vocab_size, data_dir)
    config_path = args.run_dir / f"{CONFIG_MODULE}.py"
    config_path.write_text(torchtitan_config_source(settings, tokenizer_dir=tokenizer_dir, data_dir=data_dir))
    print(f"torchtitan config generated: {config_path}")

    ours_cmd = our_command(args, overrides)
    theirs_cmd = torchtitan_command(venv_python, args)
    load_before = load_average()
    ours_runs, theirs_runs, params = [], [], {}
    for repeat in range(args.repeats):
        log = run_logged(theirs_cmd, args.run_dir / f"torchtitan.{repeat}.log", "torchtitan",
                         env={"PYTHONPATH": str(args.run_dir)})
        theirs_runs.append(steady_tokens_per_s(parse_throughput(log, TORCHTITAN_STEP), args.warmup))
        params["torchtitan"] = parse_params(log, TORCHTITAN_PARAMS, "torchtitan")
        log = run_logged(ours_cmd, args.run_dir / f"ours.{repeat}.log", "torchtitan_lite")
        ours_runs.append(steady_tokens_per_s(parse_throughput(log, OURS_STEP), args.warmup))
        params["torchtitan_lite"] = parse_params(log, OURS_PARAMS, "torchtitan_lite")
    if params["torchtitan"] != params["torchtitan_lite"]:
        raise SystemExit(f"error: the models differ: torchtitan built {params['torchtitan']:,} parameters, "
                         f"torchtitan_lite {params['torchtitan_lite']:,}; the comparison is void")

    ours, theirs = max(ours_runs), max(theirs_runs)
    load = f"host load average {load_before:.1f} at the start, {load_average():.1f} at the end" if load_before else ""
    summary = summary_text(args, settings, versions, ours_runs, theirs_runs, params["torchtitan_lite"],
                           ours_cmd, theirs_cmd, config_path, load)
    print(summary)
    print(f"\ntorchtitan {versions['torchtitan']}: {theirs:,.0f} tokens/s   torchtitan_lite: {ours:,.0f} tokens/s   "
          f"ratio torchtitan_lite / torchtitan = {ours / theirs:.2f}x")
    if args.out_md:
        write_markdown(args.out_md, summary, append=args.append)
        print(f"markdown {'appended to' if args.append else 'written to'} {args.out_md}")
    return 0


# --------------------------------------------------------------------------------------------------
# Our side


def resolve(name: str, overrides: list[str], registry: ConfigRegistry) -> tuple[Any, Settings, str]:
    """Our resolved config, the settings torchtitan must copy, and our tokenizer's path."""
    import torch

    from torchtitan_lite.config import ConfigError, parse_cli
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec
    from torchtitan_lite.tools.bare_loop import unsupported_reason

    try:
        cfg: Any = parse_cli(["--config", name, *overrides], registry=registry).config
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    reason = unsupported_reason(cfg)
    if reason is None and cfg.precision.param_dtype != "float32":
        # torchtitan 0.3.0 applies mixed precision only through FSDP's policy; a single-device run
        # would be full bfloat16 (training.dtype), a different thing from our autocast.
        reason = f"precision.param_dtype={cfg.precision.param_dtype} (only float32 has a torchtitan equivalent here)"
    if reason is not None:
        raise SystemExit(f"error: config '{name}' uses {reason}; the side-by-side covers single-device float32 "
                         f"training without compile, AC or converters")
    tokenizer = cfg.tokenizer.build()
    spec = get_model_spec(cfg.model.name)
    margs = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, min_vocab_size=tokenizer.vocab_size)
    if margs.rope_scaling is not None or margs.tie_word_embeddings:
        raise SystemExit(f"error: flavor {cfg.model.flavor!r} uses RoPE scaling or tied embeddings, which the "
                         f"generated torchtitan config does not map; use a flavor without them (e.g. debug)")
    with torch.device("meta"):
        model: Any = spec.model_cls(margs)
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    settings = Settings(
        dim=margs.dim, n_layers=margs.n_layers, n_heads=margs.n_heads, n_kv_heads=margs.n_kv_heads or margs.n_heads,
        vocab_size=margs.vocab_size, ffn_hidden_dim=model.layers["0"].feed_forward.w1.out_features,
        norm_eps=margs.norm_eps, rope_theta=margs.rope_theta, max_seq_len=margs.max_seq_len,
        seq_len=t.seq_len, local_batch_size=t.local_batch_size, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        weight_decay=o.weight_decay, warmup_steps=s.warmup_steps, decay_type=s.decay_type,
        decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor, max_norm=t.max_norm, gc_freq=t.gc_freq,
        seed=t.seed,
    )
    return cfg, settings, tokenizer.path


def our_command(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "train.py"), "--config", args.config, *overrides,
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--validation.enable", "false", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(args.run_dir / "ours_outputs")]


# --------------------------------------------------------------------------------------------------
# torchtitan's side


def torchtitan_command(python: Path, args: argparse.Namespace) -> list[str]:
    return [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(SCRIPTS_DIR / "_torchtitan_cpu.py"), "train", "--module", CONFIG_MODULE, "--config", CONFIG_FUNCTION,
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--dump_folder", str(args.run_dir / "torchtitan_outputs"), *args.torchtitan_arg]


# --------------------------------------------------------------------------------------------------
# Summary


def summary_text(args: argparse.Namespace, s: Settings, versions: dict[str, str], ours: list[float], theirs: list[float],
                 n_params: int, ours_cmd: list[str], theirs_cmd: list[str], config_path: Path, load: str = "") -> str:
    """The markdown section: device, versions, commands, model, and both trainers' steady tokens/s."""
    import torch

    def runs(values: list[float]) -> str:
        return ", ".join(f"{v:,.0f}" for v in values)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_description(torch.get_num_threads())
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    repeats = f", fastest of {args.repeats} interleaved runs" if args.repeats > 1 else ""
    return "\n".join([
        f"### torchtitan {versions['torchtitan']} vs torchtitan_lite: `{args.config}` side by side",
        "",
        f"- device: {device}; {load + '; ' if load else ''}{date}; torch {versions['torch']} in both environments; "
        f"commit {git_commit()}",
        f"- command: `{shlex.join(['python', 'scripts/torchtitan_side_by_side.py', *sys.argv[1:]])}`",
        f"- model: {n_params:,} parameters in both logs (dim {s.dim}, {s.n_layers} layers, {s.n_heads} heads, "
        f"{s.n_kv_heads} KV heads, FFN {s.ffn_hidden_dim}, vocabulary {s.vocab_size}); float32; seq {s.seq_len} x "
        f"batch {s.local_batch_size}; no compile / AC / validation / checkpoints",
        f"- {args.steps} steps per run, logged every {args.log_freq}; tokens/s over steps {args.warmup + 1}-"
        f"{args.steps}{repeats}",
        f"- torchtitan run: `{_display(theirs_cmd)}` with the generated `{_display([str(config_path)])}`",
        f"- torchtitan_lite run: `{_display(ours_cmd)}`",
        "",
        "| trainer | tokens/s (steady) | each run |",
        "|---|---|---|",
        f"| torchtitan {versions['torchtitan']} | {max(theirs):,.0f} | {runs(theirs)} |",
        f"| torchtitan_lite | {max(ours):,.0f} | {runs(ours)} |",
        f"| **ratio torchtitan_lite / torchtitan** | **{max(ours) / max(theirs):.2f}x** | |",
        "",
    ])


def _display(cmd: list[str]) -> str:
    """A command with paths inside the repository shown relative to it."""
    return shlex.join(arg.replace(str(REPO_ROOT) + os.sep, "") for arg in cmd)
