"""Train the same model with upstream torchtitan and with torchtitan_lite on this machine; print both
trainers' steady tokens/s and their ratio, for one config or for the whole matrix of cases.

    python scripts/torchtitan_side_by_side.py                        # llama3_debug as configured (fp32, eager)
    python scripts/torchtitan_side_by_side.py --matrix --repeats 2 --out-md BENCHMARKS.md --append
    python scripts/torchtitan_side_by_side.py --cases bf16-compile,bf16-compile-fsdp2

``--matrix`` runs every case of ``cases.MATRIX``: float32 and bfloat16, eager and compiled, one process
and FSDP over 2 processes, and FP8 (rowwise, and tensorwise where the installed torchtitan still has it)
with compile. Runs are interleaved (torchtitan then ours, case after case, ``--repeats`` times), and
each trainer's fastest run per case is kept: other work on a shared machine only slows a run down.

1. Environment: torchtitan is installed from the package registry into its own virtual environment
   (``--venv``, default ``.cache/torchtitan_venv``, git-ignored) next to the same torch and torchao
   versions as ours (a pinned CPU wheel where that is what we run, so no CUDA build is pulled in) and
   triton, which torchtitan 0.3.0 imports at start-up without declaring it. Nothing of torchtitan is
   vendored; the CPU shims it needs are applied at run time (scripts/_torchtitan_cpu.py lists each).
2. Data: torchtitan reads the same documents (our embedded corpus's training shards, linked into
   the run folder and opened by its ``c4_test`` JSON loader through ``dataloader.dataset_path``). Its
   wheel ships no tokenizer, so a byte-level BPE with our tokenizer's vocabulary size is trained on
   the same shards with the ``tokenizers`` package. Token ids differ; tokens per step do not.
3. Config: for every case, ``<run>/ttl_sbs_<case>.py`` is generated from our config resolved with the
   case's flags: model arguments (separate wq / wk / wv), sequence length, batch, optimizer, LR
   schedule, clipping, GC interval, compute dtype (torchtitan's FSDP mixed-precision policy, which it
   applies on every layout), compile components, float8 recipe and filter; no activation
   checkpointing, validation or checkpoints. Attention is torchtitan's own causal
   ``ScaledDotProductAttention`` (its default FlexAttention has no CPU backward), the kernel ours calls.
4. Layout: the parameter count and every Linear's kind (float8 or not) and shape are read off our
   model as the trainer builds it and printed by torchtitan's process; any difference stops the run.
5. Run: torchtitan under torchrun (one process per rank), ours as ``train.py`` (under torchrun for 2+
   ranks). Each trainer's own console throughput is parsed (torchtitan ``tps``, ours ``tok/s``; both
   count input tokens per device over the interval since the previous log line), and the logs after
   ``--warmup`` steps are combined into tokens / time.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.tools.benchmark.report import write_markdown
from torchtitan_lite.tools.benchmark.run_info import load_average
from torchtitan_lite.tools.repo import REPO_ROOT, SCRIPTS_DIR
from torchtitan_lite.tools.torchtitan_side_by_side.cases import MATRIX, Case, select_cases
from torchtitan_lite.tools.torchtitan_side_by_side.environment import (
    ensure_tokenizer,
    ensure_venv,
    link_training_shards,
    torchtitan_float8_recipes,
)
from torchtitan_lite.tools.torchtitan_side_by_side.layout import layout_difference, normalise, our_layout
from torchtitan_lite.tools.torchtitan_side_by_side.logs import (
    OURS_STEP,
    TORCHTITAN_STEP,
    parse_throughput,
    run_logged,
    steady_tokens_per_s,
)
from torchtitan_lite.tools.torchtitan_side_by_side.report import CaseResult, report_text
from torchtitan_lite.tools.torchtitan_side_by_side.torchtitan_config import (
    CONFIG_FUNCTION,
    Settings,
    parse_layout,
    torchtitan_config_source,
)

DEFAULT_TORCHTITAN = "0.3.0"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other --section.field VALUE flags override our config (before each case's own flags); the "
               "torchtitan side follows them where the generated config covers them, and the run stops before "
               "training if they need anything else.")
    parser.add_argument("--config", default="llama3_debug", help="our registry config (default llama3_debug)")
    parser.add_argument("--matrix", action="store_true", help="run every case of the matrix (see --cases)")
    parser.add_argument("--cases", metavar="A,B", help="run only these matrix cases: "
                        + ", ".join(case.key for case in MATRIX))
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps excluded (default 10)")
    parser.add_argument("--log-freq", type=int, default=10, help="both trainers' log interval (default 10)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs per trainer and case, fastest kept")
    parser.add_argument("--torchtitan-version", default=DEFAULT_TORCHTITAN, help=f"default {DEFAULT_TORCHTITAN}")
    parser.add_argument("--venv", type=Path, default=REPO_ROOT / ".cache" / "torchtitan_venv",
                        help="torchtitan's virtual environment, created when missing")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".cache" / "torchtitan_side_by_side",
                        help="generated configs, tokenizer, data links and logs")
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
    if args.matrix and args.cases:
        parser.error("--matrix runs every case; give --cases alone to run some of them")
    try:
        args.selected = select_cases(args.cases, matrix=args.matrix)
    except ValueError as err:
        parser.error(str(err))
    return args, overrides


@dataclass
class Plan:
    """One case, resolved: what both trainers run and the layout they must share."""

    case: Case
    settings: Settings
    layout: dict[str, Any]
    ours_cmd: list[str]
    theirs_cmd: list[str] = field(default_factory=list)
    module: str = ""


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Run both trainers on the cases ``argv`` selects (configs from ``registry``) and print the comparison."""
    args, overrides = parse_args(argv)
    # Every case is resolved (and refused if torchtitan cannot copy it) before anything runs.
    plans = [plan_case(case, args, overrides, registry) for case in args.selected]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    venv_python, versions = ensure_venv(args.venv, args.torchtitan_version)
    recipes = torchtitan_float8_recipes(venv_python)
    skipped = {p.case.key: f"torchtitan {versions['torchtitan']}'s float8 converter has no "
                           f"{p.case.float8_recipe!r} recipe (it offers {', '.join(recipes)})"
               for p in plans if p.settings.float8_recipe is not None and p.settings.float8_recipe not in recipes}
    runnable = [p for p in plans if p.case.key not in skipped]
    data_dir = link_training_shards(args.run_dir / "data")
    tokenizer_dir = ensure_tokenizer(venv_python, args.run_dir / "tokenizer", runnable[0].settings.vocab_size
                                     if runnable else plans[0].settings.vocab_size, data_dir)
    for plan in runnable:
        plan.module = f"ttl_sbs_{plan.case.key.replace('-', '_')}"
        source = torchtitan_config_source(plan.settings, tokenizer_dir=tokenizer_dir, data_dir=data_dir)
        (args.run_dir / f"{plan.module}.py").write_text(source)
        plan.theirs_cmd = torchtitan_command(venv_python, args, plan)

    results = {p.case.key: CaseResult(p.case, p.settings, p.layout, p.ours_cmd, p.theirs_cmd) for p in runnable}
    for repeat in range(args.repeats):
        for plan in runnable:
            run_case(plan, results[plan.case.key], repeat, args)
    text = report_text(args, versions, [results[p.case.key] for p in runnable], skipped)
    print(text)
    if args.out_md:
        write_markdown(args.out_md, text, append=args.append)
        print(f"markdown {'appended to' if args.append else 'written to'} {args.out_md}")
    return 0


def run_case(plan: Plan, result: CaseResult, repeat: int, args: argparse.Namespace) -> None:
    """One torchtitan run and one of ours for ``plan``; their steady tokens/s and the load go into ``result``."""
    tag = f"{plan.case.key}.{repeat}"
    result.loads.append(load_average())
    log = run_logged(plan.theirs_cmd, args.run_dir / f"torchtitan.{tag}.log", f"torchtitan {tag}",
                     env={"PYTHONPATH": str(args.run_dir)})
    theirs_layout = parse_layout(log)
    if theirs_layout is None:
        raise SystemExit(f"error: torchtitan's log for {tag} holds no layout line; the comparison is void")
    difference = layout_difference(plan.layout, normalise(theirs_layout))
    if difference:
        raise SystemExit(f"error: the models differ in case {plan.case.key}: {difference}; the comparison is void")
    result.theirs.append(steady_tokens_per_s(parse_throughput(log, TORCHTITAN_STEP), args.warmup))
    log = run_logged(plan.ours_cmd, args.run_dir / f"ours.{tag}.log", f"torchtitan_lite {tag}")
    result.ours.append(steady_tokens_per_s(parse_throughput(log, OURS_STEP), args.warmup))
    print(f"  {tag}: torchtitan {result.theirs[-1]:,.0f} tokens/s, torchtitan_lite {result.ours[-1]:,.0f} tokens/s",
          flush=True)


# --------------------------------------------------------------------------------------------------
# Our side


def plan_case(case: Case, args: argparse.Namespace, overrides: list[str], registry: ConfigRegistry) -> Plan:
    """Resolve our config with the case's flags; refuse what the generated torchtitan config cannot copy."""
    from torchtitan_lite.config import ConfigError, parse_cli
    from torchtitan_lite.resolved_run import resolve_run

    flags = [*overrides, *case.overrides]
    try:
        cfg: Any = parse_cli(["--config", args.config, *flags], registry=registry).config
    except ConfigError as err:
        raise SystemExit(f"error: case {case.key}: {err}") from None
    nproc = max(cfg.parallelism.dp_shard, 1)
    tokenizer = cfg.tokenizer.build()
    try:
        run = resolve_run(cfg, world_size=nproc, device_type="cpu", vocab_size=tokenizer.vocab_size)
        settings = settings_from_config(cfg, run)
    except ValueError as err:
        raise SystemExit(f"error: case {case.key} (--config {args.config} {' '.join(flags)}): {err}") from None
    return Plan(case=case, settings=settings, layout=our_layout(run), ours_cmd=our_command(args, flags, nproc))


def settings_from_config(cfg: Any, run: Any) -> Settings:
    """What torchtitan must copy from our resolved config; ValueError naming anything it has no equivalent for."""
    import torch

    reason = _unsupported(cfg, run)
    if reason is not None:
        raise ValueError(f"it uses {reason}, which the generated torchtitan config does not reproduce")
    margs = run.model_args
    if margs.rope_scaling is not None or margs.tie_word_embeddings:
        raise ValueError(f"flavor {cfg.model.flavor!r} uses RoPE scaling or tied embeddings, which the generated "
                         f"torchtitan config does not map; use a flavor without them (e.g. debug)")
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[run.precision.param_dtype]
    converters = cfg.model_converters.converters
    float8 = converters[0] if converters else None
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    return Settings(
        dim=margs.dim, n_layers=margs.n_layers, n_heads=margs.n_heads, n_kv_heads=margs.kv_heads,
        vocab_size=margs.vocab_size, ffn_hidden_dim=margs.ffn_hidden_dim, norm_eps=margs.norm_eps,
        rope_theta=margs.rope_theta, max_seq_len=margs.max_seq_len, seq_len=t.seq_len,
        local_batch_size=t.local_batch_size, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        weight_decay=o.weight_decay, warmup_steps=s.warmup_steps, decay_type=s.decay_type,
        decay_ratio=s.decay_ratio, min_lr_factor=s.min_lr_factor, max_norm=t.max_norm, gc_freq=t.gc_freq,
        seed=t.seed, param_dtype=dtype,
        compile_components=tuple(cfg.compile.components) if cfg.compile.enable else (),
        float8_recipe=None if float8 is None else float8.recipe_name,
        float8_filter_fqns=() if float8 is None else tuple(float8.filter_fqns),
        dp_shard=run.parallel_dims.dp_shard,
    )


def _unsupported(cfg: Any, run: Any) -> str | None:
    import torch

    from torchtitan_lite.components.quantization.float8 import Float8LinearConverter

    p, t = cfg.parallelism, cfg.training
    if p.tp > 1 or p.dp_replicate > 1:
        return "tensor parallelism or replicated data parallelism (the side by side covers FSDP only)"
    if cfg.activation_checkpoint.mode != "none":
        return "activation checkpointing"
    if run.n_microbatches != 1 or t.global_batch_size not in (-1, t.local_batch_size * run.parallel_dims.dp_degree):
        return "gradient accumulation"
    if cfg.optimizer.low_bit is not None:
        return "low-bit optimizer states"
    if run.precision.param_dtype not in (torch.float32, torch.bfloat16) or run.precision.loss_scaling:
        return f"precision.param_dtype={cfg.precision.param_dtype} (torchtitan trains in float32 or bfloat16 only)"
    if cfg.compile.enable and (cfg.compile.backend != "inductor" or not cfg.compile.fullgraph):
        return "a compile backend other than inductor or fullgraph=false (torchtitan compiles blocks fullgraph with inductor)"
    converters = cfg.model_converters.converters
    if len(converters) > 1 or (converters and not isinstance(converters[0], Float8LinearConverter.Config)):
        return "model converters other than one float8 converter"
    if converters:
        f8 = converters[0]
        if f8.enable_fsdp_float8_all_gather or f8.emulate or "auto_filter_small_kn" in f8.filter_fqns:
            return ("float8 all-gather, emulation or auto_filter_small_kn (the float8 settings torchtitan copies "
                    "are recipe_name and filter_fqns)")
    return None


def our_command(args: argparse.Namespace, flags: list[str], nproc: int) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        # The same launcher as torchtitan's side (torchrun sets one OpenMP thread per process on both).
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                     "--local-ranks-filter", "0"]
    return [*launcher, str(REPO_ROOT / "train.py"), "--config", args.config, *flags,
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--validation.enable", "false", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(args.run_dir / "ours_outputs")]


# --------------------------------------------------------------------------------------------------
# torchtitan's side


def torchtitan_command(python: Path, args: argparse.Namespace, plan: Plan) -> list[str]:
    return [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.settings.dp_shard}",
            "--local-ranks-filter", "0", str(SCRIPTS_DIR / "_torchtitan_cpu.py"), "train", "--module", plan.module,
            "--config", CONFIG_FUNCTION, "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--dump_folder", str(args.run_dir / "torchtitan_outputs"), *args.torchtitan_arg]
