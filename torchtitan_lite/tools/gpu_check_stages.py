"""The stages of the GPU acceptance run (scripts/gpu_check.sh): what each runs, how long it is expected to take,
and how its figure is read; the order and the budget are gpu_check.py's."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchtitan_lite.tools.gpu_check_figures import (
    BENCH_CONFIGS,
    HEAD_CONFIGS,
    PP_GPUS,
    benchmark_figure,
    bubble_figure,
    head_figure,
    layer_bench_figure,
    loss_figure,
    pp_train_figure,
    pytest_figure,
)

REPO = Path(__file__).resolve().parents[2]
PRIORITY = "bceadhifg"
"""Run order: the layer bench, the representative proxy, the MoE proxy, the CUDA tests, the loss check, the
4-block proxy, the FP8 output head on the representative proxy, then the 2-GPU stages."""
EXPECTED_S = {"a": 150, "b": 130, "c": 200, "d": 120, "e": 200, "h": 125, "i": 130, "f": 90, "g": 150}
"""Seconds each stage is expected to take on an H200, from its recorded runs (BENCHMARKS.md), rounded up:
b 119 s, c 181 s (one round), e 145 s, a 138 s (121 s of tests, blockwise left out), h 118 s on 2026-11-27
22:17-22:33 UTC; d 59 s for one seed on 2026-11-27 07:33 UTC (three seeds side by side: not yet recorded). e has
since gained a third config (the speed-filtered one, which trains like BF16: ~45 s more, an estimate). i is an
estimate, not yet recorded: two configs on stage c's proxy, one round, no profile, at c's ~60 s per config."""
BLOCKWISE_S = 420
"""Added to stage b's expected time when it times the blockwise Linear: torchao's Triton quantization
kernels autotune ~100 s per new shape (H200, 2026-11-27), four 8B shapes."""
PROXY_HEAD_SHARE = 0.10
PROXY_SEQ_LEN = 8192
PROXY_STEPS = 30
PROXY_PROFILE_STEPS = 2
SMALL_PROXY_LAYERS = 4
MOE_BENCH_CONFIGS = ("qwen3_moe_30b_a3b", "qwen3_moe_30b_a3b_fp8", "qwen3_moe_30b_a3b_fp8_experts")
"""BF16; FP8 where predicted to gain (the speed filter keeps this width's experts BF16); every expert forced FP8."""
MOE_BENCH_LAYERS = 2
MOE_BATCH = 4
"""Sequences of 4096 per step in stage e: 16,384 tokens x top-8 / 128 experts = 1,024 tokens per expert,
where FP8 rowwise grouped GEMMs break even (torchao); one sequence gives 256."""
STAGE_KEYS = "abcdefghi"
PROXY_STAGES = {"c": BENCH_CONFIGS, "i": HEAD_CONFIGS}
"""The stages on the representative proxy, with their configs: one activation checkpointing mode fits them all."""
PP_BUBBLE_ARGS = ("--flavor", "8B", "--n-layers", "8", "--seq-len", "1024", "--microbatch-size", "1",
                  "--n-microbatches", "8")
"""Stage g's model: 8B-width blocks (a ~9 ms forward per block at 1024 tokens in float32 on an H100), so
compute dominates the NCCL send/receive latency and the bubble shows."""
LAYER_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""Stage b's torchao float8 recipes (blockwise joins when the budget allows, see BLOCKWISE_S)."""
FP8_RECIPE_OF = {"llama3_8b_fp8": "tensorwise", "llama3_8b_fp8_rowwise": "rowwise"}
"""The layer bench recipe each FP8 config of stage c uses (for its expected speedup)."""
LOSS_SEEDS = 3
"""Stage d trains each config once per seed: one seed's gap at the debug scale is mostly trajectory noise."""


@dataclass
class Stage:
    key: str
    name: str
    """Short name: the log is <key>_<name>.log in the output folder."""
    title: str
    command: list[str]
    expected_s: int
    """Seconds it is expected to take (EXPECTED_S); it starts only when this fits in the budget left."""
    figure: Callable[[Path, str], tuple[bool, str]]
    """Reads the stage's outputs (its folder and its log text) -> (figures look sound, figure text)."""
    gpus: int = 1
    """GPUs the stage needs; on a machine with fewer it is skipped (``skip_reason``)."""
    note: str = ""
    """What the plan says about a choice made for this run (blockwise left out, the proxy's depth)."""


@dataclass(frozen=True)
class RunShape:
    """Choices that depend on the budget and the card, made once before the stages are built."""

    proxy_layers: int
    proxy_head_share: float
    proxy_ac: str = "selective"
    blockwise: bool = False


def choose_run_shape(budget_s: int, keys: str) -> RunShape:
    """The representative proxy's depth (head <= PROXY_HEAD_SHARE of the FLOPs) and whether the blockwise
    Linear fits: only when the chosen one-GPU stages leave BLOCKWISE_S of the budget unused."""
    import models  # noqa: F401  (registers the families)
    from torchtitan_lite.tools.proxy_model import layers_for_head_share

    proxy = layers_for_head_share("llama3", "8B", seq_len=PROXY_SEQ_LEN, max_share=PROXY_HEAD_SHARE)
    planned = sum(EXPECTED_S[k] for k in keys if k not in "fg")
    return RunShape(proxy.n_layers, proxy.head_share, blockwise="b" in keys and planned + BLOCKWISE_S <= budget_s)


def build_stages(python: str, out: Path, shape: RunShape) -> list[Stage]:
    """Every stage, in PRIORITY order."""
    scripts = REPO / "scripts"
    dense_data = ["--data.dataset", "embedded", "--tokenizer.path", "none", "--metrics.enable_tensorboard", "false"]
    # The published configs read the Llama 3 / Qwen3 tokenizer and a streamed hub corpus; a GPU machine without
    # network has neither, and throughput does not depend on which tokens flow.
    recipes = [*LAYER_RECIPES, *(["blockwise"] if shape.blockwise else [])]
    proxy = ["--model.n_layers", str(shape.proxy_layers), "--training.seq_len", str(PROXY_SEQ_LEN),
             "--training.local_batch_size", "1", "--activation_checkpoint.mode", shape.proxy_ac,
             "--compile.enable", "true", *dense_data]
    proxy_title = f"llama3_8b width, {shape.proxy_layers} blocks, seq {PROXY_SEQ_LEN}"
    stages = {
        "b": Stage("b", "float8_layer_bench", "float8 Linear bench, llama3_8b shapes, compiled",
                   [python, str(scripts / "float8_layer_bench.py"), "--shapes", "llama3_8b", "--recipes", *recipes,
                    "--json-out", str(out / "b_layers.json")],
                   EXPECTED_S["b"] + (BLOCKWISE_S if shape.blockwise else 0), layer_bench_figure,
                   note="blockwise timed (the budget leaves room for its autotuning)" if shape.blockwise else
                   f"blockwise not timed: its Triton autotuning needs ~{BLOCKWISE_S} s more than the budget leaves"),
        "c": Stage("c", "benchmark", f"representative proxy: 8B width x {shape.proxy_layers} blocks (head "
                                     f"{shape.proxy_head_share:.1%} of the FLOPs), seq {PROXY_SEQ_LEN}, AC "
                                     f"{shape.proxy_ac}, compiled",
                   [python, str(scripts / "benchmark.py"), "--configs", *BENCH_CONFIGS, "--baseline", BENCH_CONFIGS[0],
                    "--warmup", "3", "--steps", str(PROXY_STEPS), "--repeats", "2",
                    "--time-budget", str(int(EXPECTED_S["c"] * 0.9)),
                    "--profile-steps", str(PROXY_PROFILE_STEPS), "--profile-dir", str(out / "c_profiles"),
                    *proxy, "--title", proxy_title, "--out-md", str(out / "c_benchmark.md"),
                    "--json-out", str(out / "c_benchmark.json"), "--logs", str(out / "c_logs")],
                   EXPECTED_S["c"], expectation_figure),
        "e": Stage("e", "moe_benchmark", f"MoE proxy: Qwen3-30B-A3B width x {MOE_BENCH_LAYERS} blocks, seq 4096 x "
                                         f"{MOE_BATCH} (1,024 tokens per expert), compiled",
                   [python, str(scripts / "benchmark.py"), "--configs", *MOE_BENCH_CONFIGS, "--baseline",
                    MOE_BENCH_CONFIGS[0], "--warmup", "3", "--steps", "20", "--profile-steps", "2",
                    "--profile-dir", str(out / "e_profiles"), "--model.n_layers", str(MOE_BENCH_LAYERS),
                    "--training.seq_len", "4096", "--training.local_batch_size", str(MOE_BATCH),
                    "--compile.enable", "true", *dense_data,
                    "--title", f"qwen3_moe 30B-A3B width, {MOE_BENCH_LAYERS} blocks, seq 4096 x {MOE_BATCH}",
                    "--out-md", str(out / "e_benchmark.md"), "--json-out", str(out / "e_benchmark.json"),
                    "--logs", str(out / "e_logs")],
                   EXPECTED_S["e"], moe_figure),
        "a": Stage("a", "pytest", "pytest -m gpu (CUDA-only tests)",
                   [python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs",
                    *([] if shape.blockwise else ["-k", "not blockwise"]), f"--junitxml={out / 'a_pytest.xml'}"],
                   EXPECTED_S["a"], pytest_figure,
                   note="" if shape.blockwise else "the blockwise tests left out (autotuning; see stage b)"),
        "d": Stage("d", "loss_compare", f"loss curves, llama3_debug_bf16 vs llama3_debug_fp8, 200 steps x {LOSS_SEEDS} "
                                        "seeds",
                   [python, str(scripts / "loss_compare.py"), "--configs", "llama3_debug_bf16", "llama3_debug_fp8",
                    "--steps", "200", "--seeds", str(LOSS_SEEDS), "--parallel", str(2 * LOSS_SEEDS),
                    "--out", str(out / "d_loss_compare.png"), "--table", str(out / "d_loss_compare.md"),
                    "--dump-root", str(out / "d_runs")], EXPECTED_S["d"], loss_figure),
        "h": Stage("h", "small_proxy", f"extra: 8B width x {SMALL_PROXY_LAYERS} blocks (head 31% of the FLOPs), "
                                       "seq 8192, compiled",
                   [python, str(scripts / "benchmark.py"), "--configs", *BENCH_CONFIGS, "--baseline", BENCH_CONFIGS[0],
                    "--warmup", "3", "--steps", "10", "--model.n_layers", str(SMALL_PROXY_LAYERS),
                    "--training.seq_len", "8192", "--training.local_batch_size", "1", "--compile.enable", "true",
                    *dense_data, "--title", f"llama3_8b width, {SMALL_PROXY_LAYERS} layers, seq 8192",
                    "--out-md", str(out / "h_benchmark.md"), "--json-out", str(out / "h_benchmark.json"),
                    "--logs", str(out / "h_logs")], EXPECTED_S["h"], benchmark_figure("h_benchmark.json")),
        "i": head_stage(python, out, shape, proxy, proxy_title),
        "f": Stage("f", "pp_train", f"pipeline parallelism, llama3_debug, PP {PP_GPUS} x 1F1B, 20 steps",
                   ["env", f"NGPU={PP_GPUS}", str(REPO / "run_train.sh"), "--config", "llama3_debug", "--parallelism.pp",
                    str(PP_GPUS), "--parallelism.pipeline_schedule", "1F1B", "--training.steps", "20",
                    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
                    "--validation.freq", "20", "--job.dump_folder", str(out / "f_run")], EXPECTED_S["f"],
                   pp_train_figure, gpus=PP_GPUS),
        "g": Stage("g", "pipeline_bubble", f"pipeline bubble per schedule on {PP_GPUS} GPUs, 8B width x 8 blocks",
                   [python, str(scripts / "pipeline_bubble.py"), "--device", "cuda", "--pp", str(PP_GPUS),
                    *PP_BUBBLE_ARGS, "--out-md", str(out / "g_pipeline_bubble.md"), "--json-out",
                    str(out / "g_pipeline_bubble.json")], EXPECTED_S["g"], bubble_figure, gpus=PP_GPUS),
    }
    return [stages[k] for k in PRIORITY]


def head_stage(python: str, out: Path, shape: RunShape, proxy: list[str], proxy_title: str) -> Stage:
    """Stage i: the FP8 output head's share of the step, on stage c's proxy. An extra stage rather than a fourth
    config of stage c: c's ~60 s per config would take c to ~260 s, and b + c + e (530 s) would no longer fit
    the default budget (540 s). One round and no profile: the figure is one step-time ratio."""
    return Stage("i", "fp8_head", f"extra: FP8 output head, {' vs '.join(HEAD_CONFIGS)} on stage c's proxy (8B width "
                                  f"x {shape.proxy_layers} blocks, seq {PROXY_SEQ_LEN}, AC {shape.proxy_ac}), compiled",
                 [python, str(REPO / "scripts" / "benchmark.py"), "--configs", *HEAD_CONFIGS, "--baseline",
                  HEAD_CONFIGS[0], "--warmup", "3", "--steps", str(PROXY_STEPS), *proxy,
                  "--title", f"FP8 output head: {proxy_title}", "--out-md", str(out / "i_benchmark.md"),
                  "--json-out", str(out / "i_benchmark.json"), "--logs", str(out / "i_logs")],
                 EXPECTED_S["i"], head_figure)


def expectation_figure(out: Path, log: str) -> tuple[bool, str]:
    """Stage c: the throughput rows, then each FP8 recipe's expected speedup (from stage b's layer bench and
    the BF16 profile) beside the measured one, written to c_expected.md / .json."""
    from torchtitan_lite.tools import fp8_expectation

    sound, figure = benchmark_figure("c_benchmark.json")(out, log)
    layers = out / "b_layers.json"
    if not sound or not layers.exists():
        return sound, figure + ("" if layers.exists() else "; no expected speedups (stage b's layer bench is missing)")
    argv = ["--layer-bench", str(layers), "--e2e", str(out / "c_benchmark.json"), "--profiles",
            str(out / "c_profiles"), "--baseline", BENCH_CONFIGS[0], "--out-md", str(out / "c_expected.md"),
            "--json-out", str(out / "c_expected.json"), *(f"--recipe={c}={r}" for c, r in FP8_RECIPE_OF.items())]
    if fp8_expectation.main(argv) != 0:
        return False, figure + "; the expected-speedup calculation failed (see the log)"
    parts = [f"{e['config']} expected {e['expected_speedup']:.2f}x, measured {e['measured_speedup']:.2f}x "
             f"({e['ratio']:.2f} of expected{', SHORT' if e['short'] else ''})"
             for e in json.loads((out / "c_expected.json").read_text())["expectations"]
             if e["measured_speedup"] is not None]
    return sound, figure + "; " + "; ".join(parts)


def moe_figure(out: Path, log: str) -> tuple[bool, str]:
    """Stage e: the throughput rows, and both configs' step profiles by category (e_profiles.md), which show
    where the FP8 experts' time goes when they do not gain."""
    from torchtitan_lite.tools.fp8_expectation import read_profile
    from torchtitan_lite.tools.step_profile import category_table

    sound, figure = benchmark_figure("e_benchmark.json")(out, log)
    paths = [p for name in MOE_BENCH_CONFIGS if (p := out / "e_profiles" / f"{name}.json").exists()]
    if sound and len(paths) > 1:
        table = category_table({p.stem: read_profile(p)[0] for p in paths})
        (out / "e_profiles.md").write_text(table + "\n")
    return sound, figure


def plan(stages: list[Stage], keys: str, budget_s: int) -> list[tuple[Stage, bool]]:
    """The chosen stages in priority order, each with whether it fits the budget when every stage before it
    takes its expected time (multi-GPU stages count only where they run, so they are listed as fitting)."""
    used, planned = 0, []
    for stage in stages:
        if stage.key not in keys:
            continue
        fits = stage.gpus > 1 or used + stage.expected_s <= budget_s
        if fits and stage.gpus == 1:
            used += stage.expected_s
        planned.append((stage, fits))
    return planned


def size_proxy(planned: list[tuple[Stage, bool]], shape: RunShape, python: str, out: Path,
               info: dict[str, str]) -> tuple[list[tuple[Stage, bool]], str]:
    """The representative proxy's activation checkpointing (stages c and i) chosen by the memory estimate of
    their configs against this card (selective, else full); the stages are left out, with the reason, when
    neither fits."""
    keys = [s.key for s, _ in planned if s.key in PROXY_STAGES]
    if not keys or "memory_bytes" not in info:
        return planned, ""
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.tools.proxy_model import fitting_ac_mode

    first = next(s for s, _ in planned if s.key in keys)
    i = first.command.index("--model.n_layers")
    overrides = first.command[i:first.command.index("--title")]
    configs = list(dict.fromkeys(c for k in keys for c in PROXY_STAGES[k]))
    mode, peak = fitting_ac_mode(configs, [o for o in overrides], device_bytes=int(info["memory_bytes"]),
                                 registry=DEFAULT_REGISTRY)
    card = f"{int(info['memory_bytes']) / 1024**3:.0f} GiB"
    label = "stage " + keys[0] if len(keys) == 1 else "stages " + " and ".join(keys)
    if mode is None:
        return ([(s, f) for s, f in planned if s.key not in keys],
                f"{label} left out: {'its' if len(keys) == 1 else 'their'} estimated peak with full activation "
                f"checkpointing, {peak:.1f} GiB, does not fit this card's {card}")
    if mode != shape.proxy_ac:
        rebuilt = {s.key: s for s in build_stages(python, out, dataclasses.replace(shape, proxy_ac=mode))}
        planned = [(rebuilt[s.key] if s.key in keys else s, f) for s, f in planned]
    return planned, f"{label}: estimated peak {peak:.1f} GiB with AC {mode} on this card's {card} (--estimate-memory)"
