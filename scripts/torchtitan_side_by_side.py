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
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
# The repository root first: a script is started with only its own folder on sys.path.
sys.path[:0] = [str(REPO), str(SCRIPTS)]

DEFAULT_TORCHTITAN = "0.3.0"
CONFIG_MODULE = "ttl_side_by_side_config"
CONFIG_FUNCTION = "ttl_side_by_side"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TORCHTITAN_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")
_OURS_STEP = re.compile(r"step\s+(\d+)\s.*?tok/s\s+([\d,]+)")
_TORCHTITAN_PARAMS = re.compile(r"size:\s*([\d,]+) total parameters")
_OURS_PARAMS = re.compile(r"model \S+ \S+: ([\d,]+) params")


@dataclass(frozen=True)
class Settings:
    """Everything both trainers must agree on, from our resolved config."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    seq_len: int
    local_batch_size: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    decay_type: str
    decay_ratio: float | None
    min_lr_factor: float
    max_norm: float
    gc_freq: int
    seed: int | None


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
    parser.add_argument("--venv", type=Path, default=REPO / ".cache" / "torchtitan_venv",
                        help="torchtitan's virtual environment, created when missing")
    parser.add_argument("--run-dir", type=Path, default=REPO / ".cache" / "torchtitan_side_by_side",
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


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    config, settings, tokenizer_path = resolve(args.config, overrides)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    venv_python, versions = ensure_venv(args.venv, args.torchtitan_version)
    data_dir = link_training_shards(args.run_dir / "data")
    tokenizer_dir = ensure_tokenizer(venv_python, args.run_dir / "tokenizer", settings.vocab_size, data_dir)
    config_path = args.run_dir / f"{CONFIG_MODULE}.py"
    config_path.write_text(torchtitan_config_source(settings, tokenizer_dir=tokenizer_dir, data_dir=data_dir))
    print(f"torchtitan config generated: {config_path}")

    ours_cmd = our_command(args, overrides)
    theirs_cmd = torchtitan_command(venv_python, args)
    from _bench_report import load_average

    load_before = load_average()
    ours_runs, theirs_runs, params = [], [], {}
    for repeat in range(args.repeats):
        log = run_logged(theirs_cmd, args.run_dir / f"torchtitan.{repeat}.log", "torchtitan",
                         env={"PYTHONPATH": str(args.run_dir)})
        theirs_runs.append(steady_tokens_per_s(parse_throughput(log, _TORCHTITAN_STEP), args.warmup))
        params["torchtitan"] = _parse_params(log, _TORCHTITAN_PARAMS, "torchtitan")
        log = run_logged(ours_cmd, args.run_dir / f"ours.{repeat}.log", "torchtitan_lite")
        ours_runs.append(steady_tokens_per_s(parse_throughput(log, _OURS_STEP), args.warmup))
        params["torchtitan_lite"] = _parse_params(log, _OURS_PARAMS, "torchtitan_lite")
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
        from _bench_report import write_markdown

        write_markdown(args.out_md, summary, append=args.append)
        print(f"markdown {'appended to' if args.append else 'written to'} {args.out_md}")
    return 0


# --------------------------------------------------------------------------------------------------
# Our side


def resolve(name: str, overrides: list[str]):
    """Our resolved config, the settings torchtitan must copy, and our tokenizer's path."""
    import torch
    from bare_loop import unsupported_reason

    import models  # noqa: F401  (registers the model families)
    from config_registry import DEFAULT_REGISTRY
    from models import build_model_args, get_model_spec
    from torchtitan_lite.config import ConfigError, parse_cli

    try:
        cfg = parse_cli(["--config", name, *overrides], registry=DEFAULT_REGISTRY).config
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
        model = spec.model_cls(margs)
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
    return [sys.executable, str(REPO / "train.py"), "--config", args.config, *overrides,
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--validation.enable", "false", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(args.run_dir / "ours_outputs")]


def link_training_shards(data_dir: Path) -> Path:
    """A folder holding (links to) our embedded corpus's training shards, for torchtitan's JSON loader."""
    from torchtitan_lite.components.data.corpus import embedded_corpus

    data_dir.mkdir(parents=True, exist_ok=True)
    for old in data_dir.iterdir():
        old.unlink()
    for shard in embedded_corpus().train_files:
        (data_dir / Path(shard).name).symlink_to(shard)
    return data_dir


# --------------------------------------------------------------------------------------------------
# torchtitan's side


def ensure_venv(venv: Path, torchtitan_version: str) -> tuple[Path, dict[str, str]]:
    """torchtitan's interpreter (the environment is created or fixed when needed) and its versions."""
    import torch

    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    wanted = {"torchtitan": torchtitan_version, "torch": torch_version}
    if not python.exists():
        print(f"creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    versions = _installed(python)
    if any(not versions.get(name, "").startswith(version) for name, version in wanted.items()) or "triton" not in versions:
        # torch pinned to ours: an unpinned resolve would pull a multi-GB CUDA build onto a CPU machine.
        cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               f"torch=={torch_version}", f"torchtitan=={torchtitan_version}", "triton"]
        print("installing: " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        versions = _installed(python)
    return python, versions


def _installed(python: Path) -> dict[str, str]:
    probe = ("import importlib.metadata as m, json\nout = {}\nfor name in ('torchtitan', 'torch', 'triton'):\n"
             "    try: out[name] = m.version(name)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def ensure_tokenizer(python: Path, out_dir: Path, vocab_size: int, data_dir: Path) -> Path:
    config = out_dir / "tokenizer.json"
    if config.exists() and len(json.loads(config.read_text())["model"]["vocab"]) == vocab_size:
        return out_dir
    print(f"training torchtitan's tokenizer ({vocab_size} pieces) on the same shards", flush=True)
    shards = sorted(str(p) for p in data_dir.iterdir())
    subprocess.run([str(python), str(SCRIPTS / "_torchtitan_cpu.py"), "tokenizer", str(out_dir), str(vocab_size),
                    *shards], check=True)
    return out_dir


def torchtitan_config_source(s: Settings, *, tokenizer_dir: Path, data_dir: Path) -> str:
    """Python source of the config module torchtitan loads with ``--module ... --config ...``."""
    return f'''"""Generated by scripts/torchtitan_side_by_side.py: torchtitan's copy of our resolved config."""
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.config.configs import DebugConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (
    Llama3Model, _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init, parallelize_llama,
)
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

DIM, N_LAYERS, N_HEADS, N_KV_HEADS = {s.dim}, {s.n_layers}, {s.n_heads}, {s.n_kv_heads}
VOCAB_SIZE, FFN_HIDDEN_DIM, NORM_EPS = {s.vocab_size}, {s.ffn_hidden_dim}, {s.norm_eps!r}
ROPE_THETA, MAX_SEQ_LEN = {s.rope_theta!r}, {s.max_seq_len}


def {CONFIG_FUNCTION}() -> Trainer.Config:
    layers = _build_llama3_layers(
        n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, hidden_dim=FFN_HIDDEN_DIM,
        rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=MAX_SEQ_LEN, theta=ROPE_THETA),
        fuse_qkv=False,  # separate wq / wk / wv, as in our model
        attn_backend="flex",
    )
    for layer in layers:
        # FlexAttention has no CPU backward; plain causal SDPA is also what our model runs.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = NORM_EPS
    model = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB_SIZE,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB_SIZE, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB_SIZE, param_init=_output_linear_init(DIM)),
        layers=layers,
    )
    spec = ModelSpec(name="llama3", flavor="ttl_side_by_side", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path={str(tokenizer_dir)!r},
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB_SIZE),
        optimizer=default_adamw(lr={s.lr!r}, betas={s.betas!r}, eps={s.eps!r}, weight_decay={s.weight_decay!r}),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps={s.warmup_steps}, decay_type={s.decay_type!r},
                                                  decay_ratio={s.decay_ratio!r}, min_lr_factor={s.min_lr_factor!r}),
        training=TrainingConfig(seq_len={s.seq_len}, local_batch_size={s.local_batch_size}, max_norm={s.max_norm!r},
                                dtype="float32", mixed_precision_param="float32", gc_freq={s.gc_freq}),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path={str(data_dir)!r}),
        metrics=MetricsProcessor.Config(enable_tensorboard=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed={s.seed!r}),
    )
'''


def torchtitan_command(python: Path, args: argparse.Namespace) -> list[str]:
    return [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(SCRIPTS / "_torchtitan_cpu.py"), "train", "--module", CONFIG_MODULE, "--config", CONFIG_FUNCTION,
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--dump_folder", str(args.run_dir / "torchtitan_outputs"), *args.torchtitan_arg]


# --------------------------------------------------------------------------------------------------
# Logs


def run_logged(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> str:
    print(f"running {what} ...", flush=True)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", **(env or {}))
    with open(log, "w") as out:
        result = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=full_env)
    text = log.read_text()
    if result.returncode != 0:
        tail = "".join(text.splitlines(keepends=True)[-40:])
        raise SystemExit(f"error: {what} failed (exit {result.returncode}); last lines of {log}:\n{tail}")
    return text


def parse_throughput(log: str, pattern: re.Pattern) -> dict[int, float]:
    """step -> tokens/s of the interval that ends at that logged step."""
    found = {}
    for line in _ANSI.sub("", log).splitlines():
        match = pattern.search(line)
        if match:
            found[int(match.group(1))] = float(match.group(2).replace(",", ""))
    return found


def steady_tokens_per_s(per_log: dict[int, float], warmup: int) -> float:
    """Tokens / time over the log intervals after ``warmup``.

    Every such interval holds the same number of steps and so of tokens, which makes the combined
    rate the harmonic mean of the intervals' rates.
    """
    rates = [rate for step, rate in sorted(per_log.items()) if step > warmup]
    if not rates:
        raise ValueError(f"no throughput was logged after step {warmup}; logged steps: {sorted(per_log)}")
    return len(rates) / sum(1.0 / rate for rate in rates)


def _parse_params(log: str, pattern: re.Pattern, what: str) -> int:
    match = pattern.search(_ANSI.sub("", log))
    if not match:
        raise SystemExit(f"error: no parameter count found in the {what} log")
    return int(match.group(1).replace(",", ""))


def summary_text(args, s: Settings, versions: dict[str, str], ours: list[float], theirs: list[float], n_params: int,
                 ours_cmd: list[str], theirs_cmd: list[str], config_path: Path, load: str = "") -> str:
    import torch
    from _bench_report import cpu_description, git_commit

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
    return shlex.join(arg.replace(str(REPO) + os.sep, "") for arg in cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
