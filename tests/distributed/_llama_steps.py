"""A tiny Llama 3 trained for a few steps under a given layout: the shared body of the parallelism tests.

Every layout trains from the same initial weights (made on one process, then loaded into the sharded
model) on the same global batches, with the training loop's loss semantics: each rank sums token losses
of its data shard and divides by the number of target tokens of the whole global batch, and FSDP sums
gradients over data-parallel ranks. So every layout must reproduce the single-process losses.

The single-process reference of a data-parallel run computes what its ranks compute: FSDP on a one-rank
mesh (the same parameter casts in the same dtype) over each rank's share of the global batch in turn, the
gradients summed in float32 (``Run.dp_micro_batches``). Low precision rounds per rank (bf16 block outputs,
float8 scales from each rank's amax), so only such a reference can be closer to the run than the run's
precision is to float32; ``check_two_sided`` compares with tolerances of that kind and runs the
negative control.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from _collectives import CollectiveLog
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

from models.llama3.model import Llama3ModelArgs, Transformer
from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.compat import float8_recipe_needs_emulation
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
from torchtitan_lite.distributed.compile import maybe_compile_loss
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.distributed.tensor_parallel import local_loss, loss_parallel_context
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.parallelize import ParallelizeContext

# All Linear dims are multiples of 16 (float8 GEMMs need it); heads and KV heads split over tp=2.
TINY = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                       max_seq_len=64, rope_theta=10000.0)
# The blockwise FP8 recipe needs Linear dims in 128s: head_dim 128, FFN 768, so that wq / wk / wv / wo (256 x 256),
# w1 / w3 (768 x 256) and w2 (256 x 768) split over dp_shard=2 into whole 128-row blocks, and over tp=2 too.
TINY_128 = Llama3ModelArgs(dim=256, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=256, multiple_of=256,
                           max_seq_len=64, rope_theta=10000.0)
MODEL_ARGS = {"tiny": TINY, "tiny_128": TINY_128}
SEQ = 32
GLOBAL_BATCH = 4
LR = 3e-3
MAX_NORM = 1.0


@dataclass(frozen=True)
class Run:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    param_dtype: str = "float32"
    float8: str | None = None
    """torchao recipe name, or None for no float8."""
    float8_keep_hp: tuple[str, ...] = ()
    """Linears (FQN substrings) that stay in high precision besides the output projection, as
    auto_filter_small_kn keeps attention.wk / wv on 8B shapes (float8 and blockwise: their filter_fqns)."""
    mx: str | None = None
    """mx converter recipe (MXFP8, emulated on CPU), or None."""
    blockwise: bool = False
    """The float8_blockwise converter (emulated, power-of-2 scales; FP8 all-gather where shards hold whole blocks)."""
    blockwise_fp8_all_gather: bool = True
    model: str = "tiny"
    """MODEL_ARGS key: 'tiny_128' for blockwise."""
    fp8_all_gather: bool = False
    precompute: bool = False
    ac_mode: str = "none"
    ac_option: str = "op"
    compile: bool = False
    compile_backend: str = "inductor"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    reshard_after_forward: str = "default"
    steps: int = 10
    dp_micro_batches: int = 1
    """On one process: train on the global batch as this many data-parallel shares in turn under FSDP on a
    one-rank mesh (the reference of a data-parallel run); 1: the whole batch at once, no FSDP."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    def single_process(self) -> Run:
        """The reference for this run: the same numerics on one process (layout-only settings reset).

        A data-parallel run's reference keeps FSDP's casts (and float8 all-gather, which takes the float8
        weight scale from the float32 master) and its per-rank batch shares; TP alone needs neither.
        """
        defaults = Run()
        shares = self.dp_replicate * self.dp_shard * self.dp_micro_batches
        return dataclasses.replace(
            self, dp_replicate=1, dp_shard=1, tp=1, dp_micro_batches=shares,
            fp8_all_gather=self.fp8_all_gather and shares > 1, precompute=self.precompute and shares > 1,
            sequence_parallel=defaults.sequence_parallel, loss_parallel=defaults.loss_parallel,
            reshard_after_forward=defaults.reshard_after_forward,
        )

    def precision_off(self, *, keep_dtype: bool = False) -> Run:
        """The same run without float8 / MX (and in float32 unless ``keep_dtype``): the negative control."""
        return dataclasses.replace(self, float8=None, float8_keep_hp=(), mx=None, blockwise=False, fp8_all_gather=False,
                                   precompute=False, param_dtype=self.param_dtype if keep_dtype else "float32")


class _OneRankFsdp(ParallelDims):
    """FSDP on a one-rank mesh: data parallelism's parameter casts and float32 gradient sums on one process."""

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        self._one_rank = init_device_mesh(device_type, (1,), mesh_dim_names=("dp_shard",))
        return None

    @property
    def fsdp_enabled(self) -> bool:
        return True

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        return self._one_rank


@dataclass(frozen=True)
class Tolerance:
    """How far a run may be from its reference, relative; each bound is set between the layout's own
    measured difference and the measured effect of the precision under test, so that the same comparison
    of a run without that precision fails (check_two_sided)."""

    losses: float
    """max over steps of |loss - reference| / |reference|"""
    grads: float | None = None
    """max over parameters of ||grad - reference|| / ||reference|| of the first backward; None where the
    layout's own rounding is as large as the precision's effect (bf16 partial sums under TP)."""


def differences(got: dict, ref: dict) -> dict[str, float]:
    """Relative differences of ``got`` from ``ref`` over ``ref``'s steps (a longer run shares its first steps:
    the batches are the same)."""
    steps = len(ref["losses"])
    assert len(got["losses"]) >= steps, (len(got["losses"]), steps)
    out = {"losses": max(abs(a - b) / abs(b) for a, b in zip(got["losses"][:steps], ref["losses"], strict=True))}
    if "first_grads" in got and "first_grads" in ref:
        assert set(got["first_grads"]) == set(ref["first_grads"])
        out["grads"] = max(float((g - ref["first_grads"][n]).norm() / ref["first_grads"][n].norm())
                           for n, g in got["first_grads"].items())
    return out


def within(got: dict, ref: dict, tol: Tolerance) -> bool:
    diff = differences(got, ref)
    return diff["losses"] < tol.losses and (tol.grads is None or diff["grads"] < tol.grads)


def check_two_sided(got: dict, ref: dict, precision_off: dict, tol: Tolerance) -> None:
    """``got`` is within ``tol`` of ``ref`` (the same precision on one process), and ``precision_off`` (the same
    layout, or the reference, without the precision under test) is not: the test can tell that precision."""
    assert within(got, ref, tol), (differences(got, ref), tol)
    assert not within(precision_off, ref, tol), \
        f"negative control passed: without the precision the run is {differences(precision_off, ref)} from the " \
        f"reference, inside {tol}"


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences where each token determines the next (t -> 5t + 3 mod vocab), so the loss falls quickly."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, TINY.vocab_size, (GLOBAL_BATCH,), generator=g)
        for i in range(SEQ):
            tokens[:, i + 1] = (5 * tokens[:, i] + 3) % TINY.vocab_size
        labels = tokens[:, 1:].clone()
        # Unequal numbers of target tokens per rank check the normalisation by the global count.
        labels[torch.rand(labels.shape, generator=g) < 0.15] = IGNORE_INDEX
        batches.append((tokens[:, :-1].contiguous(), labels))
    return batches


def initial_state_dict(args: Llama3ModelArgs = TINY) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Transformer(args).state_dict().items()}


def parallel_config(run: Run, dims: ParallelDims) -> SimpleNamespace:
    """The facts of a resolved run that parallelize reads."""
    return SimpleNamespace(
        parallel_dims=dims,
        parallelism=ParallelismConfig(dp_replicate=run.dp_replicate, dp_shard=run.dp_shard, tp=run.tp,
                                      enable_sequence_parallel=run.sequence_parallel,
                                      enable_loss_parallel=run.loss_parallel,
                                      fsdp_reshard_after_forward=run.reshard_after_forward),
        sequence_parallel=dims.tp_enabled and run.sequence_parallel,
        loss_parallel=dims.tp_enabled and run.loss_parallel,
        activation_checkpoint=ActivationCheckpointConfig(mode=run.ac_mode, selective_option=run.ac_option),
        # compile.enable with components ['model', 'loss'], as resolve_run decides it.
        compile_model=run.compile,
        compile_loss=run.compile,
        compile_backend=run.compile_backend,
        compile_fullgraph=CompileConfig().fullgraph,
    )


def build(run: Run) -> tuple[torch.nn.Module, ParallelDims, Precision, SimpleNamespace]:
    """Meta model -> float8 conversion -> parallelize -> materialise -> load the initial weights."""
    one_rank_fsdp = run.world_size == 1 and run.dp_micro_batches > 1
    dims = (_OneRankFsdp if one_rank_fsdp else ParallelDims)(run.dp_replicate, run.dp_shard, run.tp,
                                                              world_size=run.world_size)
    args = MODEL_ARGS[run.model]
    dims.validate_for_model(args, SEQ, sequence_parallel=run.sequence_parallel)
    dims.build_mesh("cpu")
    config = parallel_config(run, dims)
    precision = Precision.Config(param_dtype=run.param_dtype).build(device="cpu", fsdp_enabled=dims.fsdp_enabled)
    with torch.device("meta"):
        model = Transformer(args)
    if run.float8:
        # emulate: as the converter does where the CPU _scaled_mm takes per-tensor scales only (torch 2.11).
        fp8_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(run.float8),
                                         enable_fsdp_float8_all_gather=run.fp8_all_gather and dims.fsdp_enabled,
                                         emulate=float8_recipe_needs_emulation(run.float8, "cpu") is not None)
        # The vocabulary projection stays in high precision, as in the project's float8 configs.
        convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda m, fqn: fqn != "output" and not any(
            keep in fqn for keep in run.float8_keep_hp))
    if run.mx:
        mx_converter(run, dims).convert(model)
    if run.blockwise:
        blockwise_converter(run, dims).convert(model)
    parallelize(model, LLAMA3_PARALLEL_PLAN, ParallelizeContext(
        parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=config.sequence_parallel,
        loss_parallel=config.loss_parallel, activation_checkpoint=config.activation_checkpoint,
        compile_model=config.compile_model, compile_backend=config.compile_backend,
        compile_fullgraph=config.compile_fullgraph,
        fsdp_reshard_after_forward=run.reshard_after_forward, fsdp_cpu_offload=False), label="llama3")
    model.to_empty(device="cpu")
    model.init_weights()
    if not (dims.fsdp_enabled or dims.tp_enabled):
        model.load_state_dict(initial_state_dict(args))
    else:
        set_model_state_dict(model, initial_state_dict(args), options=StateDictOptions(full_state_dict=True))
    return model, dims, precision, config


def mx_converter(run: Run, dims: ParallelDims):
    """The project's mx converter for ``run`` (output projection kept in high precision by default)."""
    from torchtitan_lite.components.precision import resolve_precision
    from torchtitan_lite.components.quantization import MXLinearConverter
    from torchtitan_lite.protocols.model_converter import ConversionContext

    resolved = resolve_precision(Precision.Config(param_dtype=run.param_dtype), device_type="cpu",
                                 fsdp_enabled=dims.fsdp_enabled)
    context = ConversionContext(device_type="cpu", param_dtype=resolved.param_dtype, autocast=resolved.autocast,
                                fsdp_sharded=dims.fsdp_enabled, tp_enabled=dims.tp_enabled, compile_model=run.compile,
                                seq_len=SEQ, output_module="output", blocks="layers")
    return MXLinearConverter.Config(recipe_name=run.mx).build(context=context)


def blockwise_converter(run: Run, dims: ParallelDims, plan=None):
    """The project's float8_blockwise converter for ``run``, planned for its FSDP and TP degrees and the family's
    TP ``plan`` (Llama 3's by default)."""
    from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
    from torchtitan_lite.components.precision import resolve_precision
    from torchtitan_lite.components.quantization import Float8BlockwiseConverter
    from torchtitan_lite.protocols.model_converter import ConversionContext

    resolved = resolve_precision(Precision.Config(param_dtype=run.param_dtype), device_type="cpu",
                                 fsdp_enabled=dims.fsdp_enabled)
    context = ConversionContext(device_type="cpu", param_dtype=resolved.param_dtype, autocast=resolved.autocast,
                                fsdp_sharded=dims.fsdp_enabled, tp_enabled=dims.tp_enabled, compile_model=run.compile,
                                seq_len=SEQ, output_module="output", blocks="layers",
                                dp_shard=dims.dp_shard if dims.fsdp_enabled else 1,
                                tp=dims.tp, tp_shard_dim=(plan or LLAMA3_PARALLEL_PLAN).tp_shard_dim)
    return Float8BlockwiseConverter.Config(power_of_2_scales=True, filter_fqns=list(run.float8_keep_hp),
                                           enable_fsdp_float8_all_gather=run.blockwise_fp8_all_gather).build(context=context)


def train(run: Run, model, dims: ParallelDims, precision: Precision, config, *, record_step: int | None = None,
          keep_first_grads: bool = False) -> dict:
    """Train `run.steps` steps; returns per-step global losses and gradient norms.

    record_step: log the collectives of that step's forward+backward ('fwd_bwd') and of the float8 scale
    precompute after its optimizer step ('precompute'). keep_first_grads: return the full (unsharded)
    gradients of the first backward, keyed by parameter name.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loss_fn = maybe_compile_loss(cross_entropy_sum, enabled=config.compile_loss, backend=config.compile_backend)
    shares = dims.dp_degree * run.dp_micro_batches
    rows = GLOBAL_BATCH // shares
    first_share = dims.dp_rank * run.dp_micro_batches
    out = {"losses": [], "grad_norms": [], "collectives": {}}
    for step, (global_inputs, global_labels) in enumerate(global_batches(run.steps)):
        global_tokens = (global_labels != IGNORE_INDEX).sum().float()
        recording = step == record_step
        share_losses = []
        with _log_if(recording, out, "fwd_bwd"):
            for share in range(first_share, first_share + run.dp_micro_batches):
                inputs = global_inputs[share * rows:(share + 1) * rows]
                labels = global_labels[share * rows:(share + 1) * rows]
                with precision.autocast(), loss_parallel_context(config.loss_parallel):
                    loss_sum, _ = loss_fn(model(inputs), labels)
                    loss = loss_sum / global_tokens
                    loss.backward()
                share_losses.append(loss.detach())
        if keep_first_grads and step == 0:
            out["first_grads"] = full_grads(model)
        out["grad_norms"].append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        if run.precompute:
            with _log_if(recording, out, "precompute"):
                precompute_float8_dynamic_scale_for_fsdp(model)
        value = sum(local_loss(loss) for loss in share_losses).clone()
        if dims.dp_mesh is not None:
            dist.all_reduce(value, group=dims.dp_mesh.get_group())
        out["losses"].append(float(value))
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (activation-checkpoint wrapper names removed)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return grads


@contextlib.contextmanager
def _log_if(enabled: bool, out: dict, key: str):
    if not enabled:
        yield
        return
    log = CollectiveLog()
    with log:
        yield
    out["collectives"][key] = log.calls


def run_layout(rank: int, world_size: int, run: Run, **train_kwargs) -> dict:
    """Worker: build and train `run` on this rank."""
    model, dims, precision, config = build(run)
    return train(run, model, dims, precision, config, **train_kwargs)


def run_single(run: Run, **train_kwargs) -> dict:
    """The single-process reference of `run`: in the calling process, or in one spawned gloo process where
    it needs FSDP's one-rank mesh (a process group would outlive the test in the calling process)."""
    run = run.single_process()
    if run.dp_micro_batches > 1:
        from _harness import run_ranks

        return run_ranks(run_layout, 1, run, **train_kwargs)[0]
    model, dims, precision, config = build(run)
    return train(run, model, dims, precision, config, **train_kwargs)


def train_runs(rank: int, world_size: int, runs: list[Run], **train_kwargs) -> list[dict]:
    """Worker: build and train each run in turn in one process group; gradients are kept on rank 0 only."""
    results = []
    for run in runs:
        result = run_layout(rank, world_size, run, **train_kwargs)
        if rank != 0:
            result.pop("first_grads", None)
        results.append(result)
    return results


# The layouts of the acceptance tests and the numerics trained on each.
LAYOUTS = {
    "fsdp2": dict(dp_shard=2),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "tp2": dict(tp=2),
}
VARIANTS = {
    "fp32": dict(),
    "bf16": dict(param_dtype="bfloat16"),
    "fp8": dict(float8="tensorwise", fp8_all_gather=True, precompute=True),
}
# 8B-shaped float8: wk / wv stay in high precision, so TP keeps the attention input in high precision and
# moves the FFN input and both output projections' gradients in float8.
FP8_WK_WV_HP = dict(float8="tensorwise", fp8_all_gather=True, precompute=True,
                    float8_keep_hp=("attention.wk", "attention.wv"))
# Extra runs on particular layouts: float8 all-gather without the scale precompute (to count its
# all-reduces), the other reshard policies, bf16 with float8, a row-wise recipe with 2-D FSDP x TP, and
# TP without sequence and loss parallelism, and MXFP8 (emulated on CPU: float32 isolates the layout, where
# only the order of sums differs; bf16 is the dtype MX trains in).
MX_FP32 = dict(mx="mxfp8", steps=3)
MX_BF16 = dict(param_dtype="bfloat16", mx="mxfp8", steps=3)
EXTRA_VARIANTS = {
    "fsdp2": {
        "mx_fp32": MX_FP32,
        "mx_bf16": MX_BF16,
        "fp8_no_precompute": dict(float8="tensorwise", fp8_all_gather=True, steps=2),
        "reshard_always": dict(reshard_after_forward="always", steps=2),
        "reshard_never": dict(reshard_after_forward="never", steps=2),
        "bf16_fp8": dict(param_dtype="bfloat16", float8="tensorwise", fp8_all_gather=True, precompute=True),
    },
    "fsdp2_tp2": {"rowwise": dict(float8="rowwise"), "fp8_wk_wv_hp": FP8_WK_WV_HP, "mx_fp32": MX_FP32},
    "tp2": {"no_sp_no_loss_parallel": dict(sequence_parallel=False, loss_parallel=False),
            "fp8_wk_wv_hp": FP8_WK_WV_HP, "mx_fp32": MX_FP32},
}


def layout_runs(layout: str) -> dict[str, Run]:
    variants = {**VARIANTS, **EXTRA_VARIANTS.get(layout, {})}
    return {name: Run(**LAYOUTS[layout], **kw) for name, kw in variants.items()}


@functools.cache
def layout_results(layout: str) -> dict[str, dict]:
    """Rank 0's results of every variant of `layout`, trained in one multi-process launch (cached)."""
    from _harness import run_ranks

    runs = layout_runs(layout)
    world_size = next(iter(runs.values())).world_size
    results = run_ranks(train_runs, world_size, list(runs.values()), record_step=1, keep_first_grads=True)
    return dict(zip(runs, results[0]))


@functools.cache
def single_process_results(run: Run) -> dict:
    return run_single(run, keep_first_grads=True)
