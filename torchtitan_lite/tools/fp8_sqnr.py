"""Per-Linear FP8 numerics: SQNR (dB) of the FP8 forward output and gradients against high precision.

    python scripts/fp8_sqnr.py --config llama3_debug_fp8
    python scripts/fp8_sqnr.py --config llama3_debug_fp8_rowwise --batches 4 \
        --checkpoint outputs/llama3_debug_fp8_rowwise/checkpoint
    python scripts/fp8_sqnr.py --config llama3_debug_fp8 --precision.param_dtype float32 --model.n_layers 2
    python scripts/fp8_sqnr.py --config llama3_debug_mxfp8
    python scripts/fp8_sqnr.py --config llama3_debug_fp8_blockwise

Builds the config's model (initialised from ``training.seed``, or loaded from a DCP checkpoint: a
``step-<N>`` folder, or a checkpoint folder whose newest complete step is taken), casts its
parameters to the config's ``precision.param_dtype`` as FSDP's mixed-precision policy does, and
runs ``--batches`` batches of the config's training data through it. A forward hook on every Linear
the config's FP8 converter converts runs that Linear twice on the input it receives: as is (the
high-precision reference) and as the converter's low-precision twin: torchao ``Float8Linear`` built
with the float8 converter's config, the mx converter's MXFP8 Linear (emulated MX GEMMs: the same
MX rounding as the real kernels), or the float8_blockwise converter's ``BlockwiseFP8Linear`` (emulated:
the same 1x128 / 128x128 tiles and scales as the kernels, float32 accumulation); a fixed random upstream
gradient drives both backward passes.

    SQNR = 10 * log10(||reference||^2 / ||reference - fp8||^2)

summed over all batches, for the output, the input gradient and the weight gradient. 20 dB means
the FP8 error is 10% of the signal (RMS), 30 dB about 3%. ``--min-fwd-sqnr DB`` makes the exit
status 1 when a Linear's forward SQNR falls below DB.

    python scripts/fp8_sqnr.py --check [--recipes R1,R2] [--fault NAME]

checks every FP8 recipe's layer gates on a fixed probe instead (fp8_gates.py; a planted fault from
fp8_faults.py must fail them).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_lite.components.quantization.fp8_stats_report import sqnr_db
from torchtitan_lite.config.registry import ConfigRegistry

logger = logging.getLogger("fp8_sqnr")


QUANTITIES = ("output", "grad_input", "grad_weight")


@dataclass
class LinearSqnr:
    """Signal and noise energies of one Linear, accumulated over batches; and, per row, the noise relative to
    that row's signal (``normalized_db``)."""

    fqn: str
    in_features: int
    out_features: int
    recipe: str
    signal: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0.0))
    noise: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0.0))
    relative_noise: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0.0))
    rows: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0))

    def add(self, quantity: str, reference: torch.Tensor, fp8: torch.Tensor) -> None:
        ref = reference.detach().double()
        err = ref - fp8.detach().double()
        self.signal[quantity] += float(ref.square().sum())
        self.noise[quantity] += float(err.square().sum())
        rows_ref, rows_err = self.row_view(quantity, ref), self.row_view(quantity, err)
        energy = rows_ref.square().sum(dim=-1)
        kept = energy > 0  # a row without signal (an expert without tokens) has no relative error
        self.relative_noise[quantity] += float((rows_err.square().sum(dim=-1)[kept] / energy[kept]).sum())
        self.rows[quantity] += int(kept.sum())

    @staticmethod
    def row_view(quantity: str, t: torch.Tensor) -> torch.Tensor:
        """The rows ``normalized_db`` weighs equally: a token's features for the output and the input gradient;
        the whole weight gradient of a Linear, and each expert's slice of a 3-D expert weight gradient."""
        if quantity != "grad_weight":
            return t.reshape(-1, t.shape[-1])
        return t.reshape(t.shape[0] if t.dim() == 3 else 1, -1)

    def db(self, quantity: str) -> float:
        return sqnr_db(self.signal[quantity], self.noise[quantity])

    def normalized_db(self, quantity: str) -> float:
        """SQNR with every row weighted equally: -10 log10(mean over rows of noise / signal). A token whose
        gradient is 2^-16 of another's counts as much as it does (the optimizer normalises each element's update
        by its own history, so a small gradient's relative error matters as much as a large one's)."""
        noise = self.relative_noise[quantity]
        if not math.isfinite(noise):  # an overflowed cast: NaN (e4m3) or inf (e5m2) in the result
            return -math.inf if noise == math.inf else math.nan
        return sqnr_db(float(self.rows[quantity]), noise)


# --------------------------------------------------------------------------------------------------
# Measurement


TwinFactory = Callable[[nn.Linear], nn.Linear]
"""Makes the low-precision twin of a (copied) high-precision Linear."""


def float8_twin(float8_config: Any) -> TwinFactory:
    """Twins that are torchao Float8Linears built with ``float8_config`` (torchao's Float8LinearConfig)."""
    from torchao.float8.float8_linear import Float8Linear

    return lambda linear: Float8Linear.from_float(linear, config=float8_config)


Upstream = Callable[[torch.Size, torch.Generator, int], torch.Tensor]
"""The upstream gradient of a layer's output of this shape in batch ``batch`` (on the CPU)."""


def gaussian_upstream(shape: torch.Size, generator: torch.Generator, _batch: int) -> torch.Tensor:
    """A standard normal upstream gradient: the FP8 casts use dynamic (amax) scales, so the SQNR of a correct
    recipe does not depend on the gradient's magnitude, only on its distribution."""
    return torch.randn(shape, generator=generator)


def compare_linear(linear: nn.Linear, x: torch.Tensor, fp8: nn.Module, stats: LinearSqnr, *,
                   grad_out: torch.Tensor) -> None:
    """Forward + backward of ``linear`` and of its low-precision twin ``fp8`` on ``x`` with the upstream gradient
    ``grad_out``; adds the energies to ``stats``."""
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    x_ref = x.clone().requires_grad_()
    w_ref = weight.clone().requires_grad_()
    out_ref = F.linear(x_ref, w_ref, bias)
    grad_out = grad_out.to(out_ref.device, out_ref.dtype)
    out_ref.backward(grad_out)

    fp8.weight.grad = None
    x_fp8 = x.clone().requires_grad_()
    out_fp8 = fp8(x_fp8)
    out_fp8.backward(grad_out)

    assert x_ref.grad is not None and x_fp8.grad is not None  # both backward passes reached the inputs
    assert w_ref.grad is not None and fp8.weight.grad is not None
    stats.add("output", out_ref, out_fp8)
    stats.add("grad_input", x_ref.grad, x_fp8.grad)
    stats.add("grad_weight", w_ref.grad, fp8.weight.grad)


def measure_sqnr(model: nn.Module, rows: list[Any], make_twin: TwinFactory, batches: Iterable[torch.Tensor], *,
                 seed: int = 0, upstream: Upstream = gaussian_upstream,
                 around_twins: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] | None = None,
                 around_layer: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None) -> list[LinearSqnr]:
    """SQNR statistics for every converted plan row (``row.recipe`` set) of ``model``, over ``batches``.

    ``model`` is the high-precision model (parameters already in the compute dtype); each batch is a
    LongTensor of token ids [batch, seq] on the model's device. Each layer is compared inside a hook
    on its input as the model's forward reaches it, so no activations are kept. Each layer's twin is built
    once and serves every batch, as a converted model's layer serves every step. ``around_twins(twins)`` (an
    nn.ModuleList of the twins) is entered around all batches, ``around_layer(fqn)`` around each comparison.
    """
    converted = [row for row in rows if row.recipe is not None]
    if not converted:
        raise ValueError("the FP8 converter converts no Linear of this model (see --print-fp8-plan for why)")
    modules = dict(model.named_modules())
    stats = {row.fqn: LinearSqnr(row.fqn, row.in_features, row.out_features, row.recipe) for row in converted}
    linears = {fqn: cast(nn.Linear, modules[fqn]) for fqn in stats}  # the plan converts nn.Linear modules only
    twins = {fqn: make_twin(copy.deepcopy(linear)) for fqn, linear in linears.items()}
    generator = torch.Generator().manual_seed(seed)
    batch_index = 0

    def compare_on_input(fqn: str, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        grad_out = upstream(torch.Size((*x.shape[:-1], linears[fqn].out_features)), generator, batch_index)
        with torch.enable_grad(), around_layer(fqn) if around_layer else contextlib.nullcontext():
            compare_linear(linears[fqn], x, twins[fqn], stats[fqn], grad_out=grad_out)

    handles = [linear.register_forward_pre_hook(lambda m, a, fqn=fqn: compare_on_input(fqn, a))
               for fqn, linear in linears.items()]
    try:
        with around_twins(nn.ModuleList(twins.values())) if around_twins else contextlib.nullcontext():
            for batch_index, tokens in enumerate(batches):  # noqa: B007  (read by compare_on_input)
                with torch.no_grad():
                    model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return list(stats.values())


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters (not buffers: the rotary cache stays complex) to ``dtype``, as FSDP's mixed precision does."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


# --------------------------------------------------------------------------------------------------
# Report


def format_report(results: list[LinearSqnr], *, min_fwd_sqnr: float | None = None) -> str:
    """Aligned per-Linear table, a min / mean line per recipe, and the verdict on ``min_fwd_sqnr``."""
    header = ("fqn", "shape (in x out)", "recipe", "fwd dB", "grad_input dB", "grad_weight dB")
    body = [(r.fqn, f"{r.in_features} x {r.out_features}", r.recipe,
             *(f"{r.db(q):.1f}" for q in QUANTITIES)) for r in results]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    numeric = range(3, len(header))

    def fmt(line: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))

    lines = [fmt(header), *(fmt(line) for line in body), ""]
    for recipe in dict.fromkeys(r.recipe for r in results):
        group = [r for r in results if r.recipe == recipe]
        parts = []
        for q in QUANTITIES:
            values = [r.db(q) for r in group]
            parts.append(f"{q} min {min(values):.1f} / mean {sum(values) / len(values):.1f} dB")
        lines.append(f"{recipe} ({len(group)} Linear layers): " + "; ".join(parts))
    if min_fwd_sqnr is not None:
        low = [r.fqn for r in results if r.db("output") < min_fwd_sqnr]
        lines.append(f"forward SQNR below {min_fwd_sqnr:g} dB: {', '.join(low)}" if low
                     else f"every forward SQNR is above {min_fwd_sqnr:g} dB")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Model, data and converter from a config


def float8_converter_config(cfg: Any, config_name: str) -> Any:
    """The config's FP8 converter entry (float8, mx or float8_blockwise); ValueError naming the fix when it has
    none."""
    from torchtitan_lite.components.quantization import Float8LinearConverter, MXLinearConverter
    from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter

    kinds = (Float8LinearConverter.Config, MXLinearConverter.Config, Float8BlockwiseConverter.Config)
    entries = [c for c in cfg.model_converters.converters if isinstance(c, kinds)]
    if not entries:
        raise ValueError(f"config '{config_name}' has no FP8 converter; use an FP8 config (e.g. llama3_debug_fp8, "
                         f"llama3_debug_mxfp8 or llama3_debug_fp8_blockwise) or add one with "
                         f"--model_converters.converters float8 (or mx, float8_blockwise)")
    return entries[0]


def twin_factory(converter_config: Any, cfg: Any) -> TwinFactory:
    """The low-precision twin of a Linear as the config's converter would train it."""
    from torchtitan_lite.components.quantization import MXLinearConverter
    from torchtitan_lite.components.quantization.float8_blockwise import Float8BlockwiseConverter

    if isinstance(converter_config, Float8BlockwiseConverter.Config):
        return blockwise_twin(power_of_2=converter_config.power_of_2_scales)
    if not isinstance(converter_config, MXLinearConverter.Config):
        return float8_twin(effective_float8_config(converter_config, cfg))
    converter = _quietly(lambda: MXLinearConverter(converter_config, context=_probe_context(cfg)),
                         "torchtitan_lite.components.quantization.mx")
    return converter.mx_linear


def blockwise_twin(*, power_of_2: bool) -> TwinFactory:
    """Twins that are emulated BlockwiseFP8Linears: the tiles and scales of torchao's kernels (which need an sm_90
    GPU), so the SQNR is the recipe's on any device."""
    from torchtitan_lite.components.quantization.blockwise_linear import blockwise_linear_from

    return lambda linear: blockwise_linear_from(linear, emulate=True, power_of_2=power_of_2)


def _probe_context(cfg: Any) -> Any:
    """The run's conversion context as this CPU probe sees it: FSDP-style parameter casts, no autocast."""
    from torchtitan_lite.components.precision import resolve_precision
    from torchtitan_lite.protocols.model_converter import ConversionContext
    from torchtitan_lite.protocols.model_spec import get_model_spec

    precision = resolve_precision(cfg.precision, device_type="cpu", fsdp_enabled=True)
    plan = get_model_spec(cfg.model.name).parallel_plan
    return ConversionContext(device_type="cpu", param_dtype=precision.param_dtype, autocast=False,
                             fsdp_sharded=True, tp_enabled=False, compile_model=False, seq_len=cfg.training.seq_len,
                             output_module=plan.output, blocks=plan.blocks)


def _quietly(build: Callable[[], Any], logger_name: str) -> Any:
    """``build()`` with the converter's logger at ERROR: training-speed advice (compile, emulation) does not
    apply to a numerics probe."""
    converter_logger = logging.getLogger(logger_name)
    level = converter_logger.level
    converter_logger.setLevel(logging.ERROR)
    try:
        return build()
    finally:
        converter_logger.setLevel(level)


def effective_float8_config(converter_config: Any, cfg: Any) -> Any:
    """torchao's Float8LinearConfig as the converter builds it.

    The converter is built for the FSDP layout because this script casts parameters to param_dtype the
    way FSDP does (not with autocast). FP8 all-gather is then turned off: it changes how the weight
    travels, not its FP8 value (the scale is the amax of the whole weight either way).
    """
    from torchtitan_lite.components.quantization.float8 import Float8LinearConverter

    converter = _quietly(lambda: Float8LinearConverter(converter_config, context=_probe_context(cfg)),
                         "torchtitan_lite.components.quantization.float8")
    return dataclasses.replace(converter.float8_config, enable_fsdp_float8_all_gather=False)


def build_model(cfg: Any, device: torch.device, vocab_size: int) -> nn.Module:
    """The config's model on ``device``, initialised from ``training.seed``, in eval mode."""
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    spec = get_model_spec(cfg.model.name)
    args = build_model_args(spec, cfg.model.flavor, n_layers=cfg.model.n_layers, min_vocab_size=vocab_size,
                            hf_config=cfg.model.hf_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    if cfg.training.seed is not None:
        torch.manual_seed(cfg.training.seed)
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def resolve_checkpoint(path: str) -> str:
    """``path`` itself when it is a DCP folder, else its newest complete ``step-<N>`` subfolder."""
    from torchtitan_lite.components.checkpoint.layout import describe_steps, is_dcp_folder, scan_steps, step_dir
    from torchtitan_lite.components.checkpoint.verify import CheckpointError

    if is_dcp_folder(path):
        return path
    complete, _ = scan_steps(path)
    if complete:
        return step_dir(path, complete[-1])
    if os.path.isdir(os.path.join(path, "checkpoint")):
        raise CheckpointError(f"{path} holds no step-<N> checkpoint; did you mean {os.path.join(path, 'checkpoint')}?")
    raise CheckpointError(f"{path} is neither a DCP checkpoint folder nor a folder of complete step-<N> "
                          f"checkpoints ({describe_steps(path)})")


def load_model_checkpoint(model: nn.Module, path: str) -> str:
    """Load the model state of the DCP checkpoint at ``path`` (see resolve_checkpoint); returns the folder used."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.components.checkpoint import ModelWrapper
    from torchtitan_lite.components.checkpoint.verify import WeightsOnlyLoadPlanner, check_compatible, read_metadata

    folder = resolve_checkpoint(path)
    wrapper = ModelWrapper(model)
    state = {"model": wrapper.state_dict()}
    check_compatible(folder, read_metadata(folder), state, exact_prefixes=("model.",))
    dcp.load(state, checkpoint_id=folder, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    wrapper.load_state_dict(state["model"])
    return folder


def token_batches(cfg: Any, tokenizer: Any, count: int, device: torch.device) -> list[torch.Tensor]:
    """The first ``count`` input batches of the config's training data, on ``device``."""
    loader = cfg.data.build(tokenizer=tokenizer, dp_rank=0, dp_world_size=1, seq_len=cfg.training.seq_len,
                            local_batch_size=cfg.training.local_batch_size, split="train", infinite=True,
                            seed=cfg.training.seed)
    batches = []
    for inputs, _labels in loader:
        batches.append(inputs.to(device))
        if len(batches) == count:
            return batches
    return batches


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's flags, checked, and the remaining config flags."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        usage="%(prog)s --config NAME [--checkpoint DIR] [--batches N] [--min-fwd-sqnr DB] [--section.field VALUE ...]\n"
              "       %(prog)s --check [--recipes R1,R2] [--fault NAME]",
        epilog="Other flags (--config, --config-file, --section.field VALUE) select and override the config as in train.py.")
    parser.add_argument("--checkpoint", default=None, help="DCP step-<N> folder, or a checkpoint folder (newest complete step)")
    parser.add_argument("--batches", type=int, default=2, help="training batches to measure over")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random upstream gradients")
    parser.add_argument("--min-fwd-sqnr", type=float, default=None, metavar="DB",
                        help="exit with status 1 when a Linear's forward SQNR is below DB")
    parser.add_argument("--check", action="store_true",
                        help="check every FP8 recipe's layer gates on a fixed probe (fp8_gates.py); no --config")
    parser.add_argument("--recipes", default=None, metavar="R1,R2",
                        help="with --check: only these recipes (default: all)")
    parser.add_argument("--fault", default=None, metavar="NAME",
                        help="with --check: plant this fault (fp8_faults.py) into the recipes it applies to; the "
                             "gates must then fail")
    args, rest = parser.parse_known_args(argv)
    if not args.check and (args.recipes or args.fault):
        parser.error("--recipes and --fault go with --check")
    if args.check and rest:
        parser.error(f"--check runs a fixed probe and takes no config flags, got {' '.join(rest)}")
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    return args, rest


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    """Measure the config selected by ``argv`` (``--config NAME`` from ``registry``); exit status 0, 1 or 2."""
    args, config_argv = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()
    if args.check:  # scripts/fp8_sqnr.py routes --check to the gates (fp8_sqnr_cli.py) before this
        print("error: --check runs the layer gates: use scripts/fp8_sqnr.py --check", file=sys.stderr)
        return 2
    from torchtitan_lite.components.checkpoint.verify import CheckpointError
    from torchtitan_lite.components.quantization.float8_plan import float8_plan
    from torchtitan_lite.config import ConfigError, parse_cli
    from torchtitan_lite.mesh import process_groups as dist_utils

    try:
        cli = parse_cli(config_argv, registry=registry)
        if cli.action != "train":
            raise ConfigError("fp8_sqnr takes --config, --config-file and --section.field flags only, no train.py action")
        cfg: Any = cli.config  # set: the action is train
        converter_config = float8_converter_config(cfg, cli.config_name)
        device = torch.device(dist_utils.device_type())
        precision = cfg.precision.build(device=device, fsdp_enabled=False)
        make_twin = twin_factory(converter_config, cfg)
        tokenizer = cfg.tokenizer.build()
        model = build_model(cfg, device, tokenizer.vocab_size)
        source = f"initialised from seed {cfg.training.seed}"
        if args.checkpoint is not None:
            source = f"loaded from {load_model_checkpoint(model, args.checkpoint)}"
        probe = _probe_context(cfg)
        rows = float8_plan(model, converter_config, output_module=probe.output_module, blocks=probe.blocks)
        cast_parameters(model, precision.param_dtype)
        batches = token_batches(cfg, tokenizer, args.batches, device)
        results = measure_sqnr(model, rows, make_twin, batches, seed=args.seed)
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = str(precision.param_dtype).removeprefix("torch.")
    t = cfg.training
    print(f"\n{cli.config_name}: model {source}; high precision = {dtype} parameters and activations; "
          f"{len(batches)} batch(es) of {t.local_batch_size} x {t.seq_len} tokens\n")
    print(format_report(results, min_fwd_sqnr=args.min_fwd_sqnr))
    if args.min_fwd_sqnr is not None and any(r.db("output") < args.min_fwd_sqnr for r in results):
        return 1
    return 0
