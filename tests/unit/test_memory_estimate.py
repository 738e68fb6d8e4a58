"""Memory estimate: exact parameter / gradient / optimizer-state bytes of really built models, the saved
activations of a block against autograd, the whole-step peak against the CPU profiler, and the sharding
arithmetic on meta."""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from models import build_model_args, get_model_spec
from models.llama3 import Llama3ModelArgs, Transformer
from torchtitan_lite.actions import launch_run
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.components.optimizer import OptimizersContainer
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.config.sections import (
    ActivationCheckpointConfig,
    ModelConfig,
    ParallelismConfig,
    TrainingConfig,
)
from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.memory.activations import ActivationSetup, block_plan, block_saved_bytes
from torchtitan_lite.memory.estimate import CUDA_CONTEXT_BYTES, estimate_memory, estimate_memory_text
from torchtitan_lite.memory.optimizer_states import state_bytes
from torchtitan_lite.protocols.model_converter import ModelConvertersContainer
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread():
    # The models here are tiny: one intra-op thread beats two that compete with the rest of the suite.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _config(*, n_layers=2, seq_len=64, batch=2, param_dtype="float32", ac="none", selective_option="op",
            low_bit=None, float8=None, implementation="auto", global_batch=-1, **parallelism) -> Trainer.Config:
    converters = [] if float8 is None else [Float8LinearConverter.Config(recipe_name=float8, **(
        {"enable_fsdp_float8_all_gather": True} if float8 == "tensorwise" else {}))]
    return Trainer.Config(
        model=ModelConfig(flavor="debug", n_layers=n_layers),
        training=TrainingConfig(seq_len=seq_len, local_batch_size=batch, global_batch_size=global_batch),
        precision=Precision.Config(param_dtype=param_dtype),
        parallelism=ParallelismConfig(**parallelism),
        activation_checkpoint=ActivationCheckpointConfig(mode=ac, selective_option=selective_option),
        model_converters=ModelConvertersContainer.Config(converters=converters),
        optimizer=OptimizersContainer.Config(low_bit=low_bit, implementation=implementation),
    )


def _build(cfg: Trainer.Config):
    """The model as the trainer builds it for one process on CPU, plus its precision and optimizer."""
    run = resolve_run(cfg, world_size=1, device_type="cpu")
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    run.converters.convert(model)
    precision = cfg.precision.build(device="cpu", resolved=run.precision)
    model = parallelize(model, run.model_spec.parallel_plan, run.parallelize_context(mp_policy=precision.mp_policy()),
                        label=run.model_spec.name)
    model.to_empty(device="cpu")
    model.init_weights()
    return model, precision, cfg.optimizer.build(model_parts=[model])


def _train_step(cfg, model, precision, optimizer) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    tokens, labels = torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen)
    with precision.autocast():
        logits = model(tokens)
        loss, _ = cross_entropy_sum(logits, labels)
        del logits
        loss.backward()
    optimizer.step()


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor stores: a DTensor's local shard; a torchao subclass's inner tensors (codes, scales, qmap)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return sum(_nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer states: exact against the built model


@pytest.mark.parametrize("n_layers", [None, 2], ids=["debug", "debug-2-layers"])
@pytest.mark.parametrize("low_bit", [None, "adamw8bit", "adamw4bit", "adamw_fp8"])
def test_param_grad_and_optimizer_bytes_equal_the_built_model(n_layers, low_bit):
    cfg = _config(n_layers=n_layers, seq_len=16, batch=1, low_bit=low_bit)
    model, precision, optimizer = _build(cfg)
    # torchao creates the states, then runs its compiled update; skipping the update (seconds of compile or
    # of eager quantization on CPU) leaves exactly the states the step creates.
    with mock.patch("torch.compile", lambda fn, **_: lambda *args, **kwargs: None):
        _train_step(cfg, model, precision, optimizer)
    params = list(model.parameters())
    states = [v for opt in optimizer for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    if low_bit is not None:
        assert any(type(v) is not torch.Tensor for v in states), "no quantized state was created"

    est = estimate_memory(cfg, world_size=1, device_type="cpu")
    assert est.parameters == sum(_nbytes(p) for p in params)
    assert est.gradients == sum(_nbytes(p.grad) for p in params)
    assert est.optimizer_states == sum(_nbytes(v) for v in states)


def test_float8_conversion_keeps_parameter_and_state_bytes():
    cfg = _config(float8="rowwise", seq_len=16, batch=1)
    model, precision, optimizer = _build(cfg)
    _train_step(cfg, model, precision, optimizer)
    est = estimate_memory(cfg, world_size=1, device_type="cpu")
    assert est.parameters == sum(_nbytes(p) for p in model.parameters())
    assert est.optimizer_states == optimizer.state_nbytes()


@pytest.mark.parametrize("low_bit", ["adamw8bit", "adamw4bit", "adamw_fp8"])
@pytest.mark.parametrize("numel", [4095, 4096, 4096 + 128, 65536])
def test_low_bit_state_bytes_follow_torchao_thresholds(low_bit, numel):
    # Below 4096 elements, or not a multiple of the block (256 for 8-bit/fp8, 128 for 4-bit), torchao
    # keeps fp32 moments; 4096 + 128 is quantized by 4-bit only.
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    optimizer = OptimizersContainer.Config(low_bit=low_bit).build(model_parts=[_Holder(param)])
    with mock.patch("torch.compile", lambda fn, **_: lambda *args, **kwargs: None):  # states only, as above
        optimizer.step()
    assert state_bytes(numel, low_bit) == optimizer.state_nbytes()


class _Holder(torch.nn.Module):
    def __init__(self, param: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = param


def test_low_bit_optimizer_states_are_a_fraction_of_adamw():
    adamw = estimate_memory(_config(n_layers=None), world_size=1, device_type="cpu").optimizer_states
    ratios = {lb: estimate_memory(_config(n_layers=None, low_bit=lb), world_size=1, device_type="cpu")
              .optimizer_states / adamw for lb in ("adamw8bit", "adamw_fp8", "adamw4bit")}
    # 2 bytes (8-bit, fp8) and 1 byte (4-bit) of codes per parameter instead of 8, plus block scales.
    assert 0.25 < ratios["adamw8bit"] < 0.27 and 0.25 < ratios["adamw_fp8"] < 0.27
    assert 0.125 < ratios["adamw4bit"] < 0.14


# --------------------------------------------------------------------------------------------------
# Activations: the saved set of one block against autograd


def _saved_bytes_of_block(block, x, rope, *, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in one block's forward, parameters excluded."""
    exclude = {t.untyped_storage().data_ptr() for t in list(block.parameters()) + [rope]}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        block(x, rope)
    # Autocast's weight casts are not activations: the estimate counts them as a term of their own.
    cast_weights = sum(p.numel() * 2 for name, p in block.named_parameters() if autocast and "norm" not in name)
    return sum(seen.values()) - cast_weights


@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("precision", ["float32", "bf16-params", "bf16-autocast"])
def test_block_saved_bytes_match_autograd_saved_tensors(n_kv_heads, precision):
    args = Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=128, multiple_of=32,
                           max_seq_len=64)
    model = Transformer(args)
    batch, seq = 2, 32
    # bf16-params: parameters cast like FSDP's mixed-precision policy does (residual stream in bf16 too).
    if precision == "bf16-params":
        model = model.to(torch.bfloat16)
    block, rope = model.layers["0"], model.rope.cache
    residual = torch.bfloat16 if precision == "bf16-params" else torch.float32
    x = torch.randn(batch, seq, args.dim, dtype=residual, requires_grad=True)
    low = precision != "float32"
    setup = ActivationSetup(
        tokens=batch * seq, dim=args.dim, n_heads=args.n_heads, n_kv_heads=n_kv_heads, head_dim=args.head_dim,
        ffn_dim=args.ffn_hidden_dim, vocab_size=args.vocab_size, n_layers=1, tp=1, sequence_parallel=False,
        loss_parallel=False, compute_bytes=2 if low else 4, residual_bytes=2 if precision == "bf16-params" else 4,
        autocast=precision == "bf16-autocast", device_type="cpu", compiled_loss=False,
    )
    measured = _saved_bytes_of_block(block, x, rope, autocast=precision == "bf16-autocast")
    # Exact: the formula lists every saved storage; the block input counts since the first norm saves it.
    assert sum(block_saved_bytes(setup).values()) == measured


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op")])
def test_checkpointed_block_keeps_what_the_plan_says(mode, option):
    args = Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                           max_seq_len=64)
    model = Transformer(args)
    apply_ac(model.layers, mode, option)
    batch, seq = 2, 32
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model.layers["0"](x, model.rope.cache)
    alive = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    setup = ActivationSetup(
        tokens=batch * seq, dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
        ffn_dim=args.ffn_hidden_dim, vocab_size=args.vocab_size, n_layers=1, tp=1, sequence_parallel=False,
        loss_parallel=False, compute_bytes=4, residual_bytes=4, autocast=False,
        device_type="cpu", compiled_loss=False,
    )
    kept, _ = block_plan(setup, mode, option)[0]
    # The block input was allocated before profiling, so what stays allocated is the output plus what the
    # checkpoint keeps besides its input. Tolerance: the policy's float8-free amax/max outputs and the
    # checkpoint's small bookkeeping tensors (< 1 KiB here).
    input_bytes = x.numel() * x.element_size()
    assert abs(alive - out.numel() * out.element_size() - (kept - input_bytes)) < 1024


def test_activation_checkpoint_modes_order_activations():
    def activations(mode, option="op"):
        cfg = _config(n_layers=None, seq_len=256, batch=8, ac=mode, selective_option=option)
        return estimate_memory(cfg, world_size=1, device_type="cuda")["activations"]

    none, op, every2, full = activations("none"), activations("selective"), activations("selective", "2"), \
        activations("full")
    assert none > every2 > op > full > 0
    # Every 2nd of 6 blocks checkpointed: exactly halfway between none and full.
    assert every2 == (none + full) // 2


# --------------------------------------------------------------------------------------------------
# The whole step against the CPU profiler


def _measured_peak(cfg) -> int:
    """Peak bytes allocated during the second training step (first one creates the optimizer state)."""
    model, precision, optimizer = _build(cfg)
    _train_step(cfg, model, precision, optimizer)
    optimizer.zero_grad()
    resident = sum(_nbytes(t) for t in list(model.parameters()) + list(model.buffers())) + optimizer.state_nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _train_step(cfg, model, precision, optimizer)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return resident + peak


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(ac="full"),
    dict(ac="selective"),
    dict(ac="selective", selective_option="2"),
    dict(implementation="foreach"),
    dict(param_dtype="bfloat16", seq_len=32),
    dict(param_dtype="bfloat16", seq_len=32, ac="selective"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "fp32")
def test_estimated_peak_matches_the_cpu_profiler(overrides):
    cfg = _config(**{"seq_len": 256, **overrides})
    est = estimate_memory(cfg, world_size=1, device_type="cpu")
    measured = _measured_peak(cfg)
    # 3%: the timeline models every tensor of at least one block's activations; what it leaves out are
    # scalars, norm statistics of a single op and index tensors (measured gaps are 0-2% here).
    assert est.peak_allocated == pytest.approx(measured, rel=0.03), est.peak_moment


# --------------------------------------------------------------------------------------------------
# Sharding arithmetic (meta only)


def test_fsdp_divides_parameters_gradients_and_moments():
    one = estimate_memory(_config(n_layers=None), world_size=1, device_type="cuda")
    eight = estimate_memory(_config(n_layers=None), world_size=8, device_type="cuda")
    n_tensors = 6 * 9 + 3  # per block: 7 Linears + 2 norms; embedding, final norm, output
    # Every debug dim divides by 8, so no padding; each parameter keeps its 4-byte `step` unsharded.
    assert eight.parameters * 8 == one.parameters
    assert eight.gradients * 8 == one.gradients
    assert (eight.optimizer_states - 4 * n_tensors) * 8 == one.optimizer_states - 4 * n_tensors


def test_hsdp_replicas_hold_the_same_shards_as_fsdp_over_the_shard_group():
    fsdp4 = estimate_memory(_config(n_layers=None), world_size=4, device_type="cuda")
    hsdp = estimate_memory(_config(n_layers=None, dp_replicate=2, dp_shard=4), world_size=8, device_type="cuda")
    for name in ("parameters", "gradients", "optimizer states"):
        assert hsdp[name] == fsdp4[name]


def test_uneven_fsdp_shards_are_padded_to_the_largest():
    est = estimate_memory(_config(n_layers=1), world_size=3, device_type="cuda")
    args = build_model_args(get_model_spec("llama3"), "debug", n_layers=1)
    shapes = [(args.vocab_size, args.dim)] * 2 + [(args.dim,)] * 3 + [
        (args.dim, args.dim), (args.n_kv_heads * args.head_dim, args.dim), (args.n_kv_heads * args.head_dim, args.dim),
        (args.dim, args.dim), (args.ffn_hidden_dim, args.dim), (args.dim, args.ffn_hidden_dim),
        (args.ffn_hidden_dim, args.dim)]
    assert est.parameters == 4 * sum(math.ceil(s[0] / 3) * math.prod(s[1:]) for s in shapes)


def test_tp_shards_matrices_and_fsdp_the_rest():
    one = estimate_memory(_config(n_layers=None), world_size=1, device_type="cuda")
    tp2_fsdp4 = estimate_memory(_config(n_layers=None, tp=2, dp_shard=4), world_size=8, device_type="cuda")
    args = build_model_args(get_model_spec("llama3"), "debug")
    norms = (2 * args.n_layers + 1) * args.dim * 4
    # Matrices are split 8 ways (TP 2 x FSDP 4); norm scales are replicated over TP, sharded by FSDP only.
    assert tp2_fsdp4.parameters == (one.parameters - norms) // 8 + norms // 4


def test_tp_with_sequence_parallel_halves_everything_but_the_gathered_norm_outputs():
    def block(tp, sp):
        cfg = _config(n_layers=None, seq_len=256, batch=4, param_dtype="bfloat16", tp=tp, dp_shard=1,
                      enable_sequence_parallel=sp)
        layout_setup = dict(tokens=1024, dim=256, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, vocab_size=2048,
                            n_layers=6, tp=tp, sequence_parallel=sp, loss_parallel=True, compute_bytes=2,
                            residual_bytes=4, autocast=True, device_type="cuda", compiled_loss=False)
        assert estimate_memory(cfg, world_size=tp, device_type="cuda")["activations"] == 6 * sum(
            block_saved_bytes(ActivationSetup(**layout_setup)).values())
        return block_saved_bytes(ActivationSetup(**layout_setup))

    one, sp, no_sp = block(1, False), block(2, True), block(2, False)
    for part in ("norms", "q, k, v", "sdpa", "swiglu"):
        assert sp[part] * 2 == one[part], part
    assert sp["norm outputs"] == one["norm outputs"]
    assert no_sp["norms"] == one["norms"]


def test_loss_parallel_divides_the_loss_by_tp():
    with_lp = estimate_memory(_config(seq_len=256, tp=2, dp_shard=1), world_size=2, device_type="cuda")
    without = estimate_memory(_config(seq_len=256, tp=2, dp_shard=1, enable_loss_parallel=False), world_size=2,
                              device_type="cuda")
    # Loss parallel: 16 bytes per token per vocab shard (one more fp32 temporary) instead of 12 per full vocab.
    assert with_lp["loss transient"] * 12 * 2 == without["loss transient"] * 16


def test_tp_embedding_gradient_is_full_size_without_fsdp():
    est = estimate_memory(_config(n_layers=1, tp=2, dp_shard=1), world_size=2, device_type="cuda")
    args = build_model_args(get_model_spec("llama3"), "debug", n_layers=1)
    embedding = args.vocab_size * args.dim * 4
    assert est.gradients - est.parameters == embedding // 2


def test_float8_all_gather_gathers_converted_weights_in_one_byte():
    bf16 = estimate_memory(_config(n_layers=None, param_dtype="bfloat16", float8="rowwise"), world_size=8,
                           device_type="cuda")
    fp8 = estimate_memory(_config(n_layers=None, param_dtype="bfloat16", float8="tensorwise"), world_size=8,
                          device_type="cuda")
    args = build_model_args(get_model_spec("llama3"), "debug")
    block_linears = args.dim * (2 * args.dim + 2 * args.n_kv_heads * args.head_dim + 3 * args.ffn_hidden_dim)
    norms = 2 * args.dim

    def gathered(est):  # block 3 computing, block 2 prefetched
        return est.moment("block 3 backward").parts["FSDP gathered"]

    # Linears float8 (1 byte) with the all-gather on, bf16 (2 bytes) without; norm scales stay bf16.
    assert gathered(bf16) == 2 * (2 * block_linears + 2 * norms)
    assert gathered(fp8) == 2 * (block_linears + 2 * norms)


# --------------------------------------------------------------------------------------------------
# Phases, options and text


def test_gradient_accumulation_keeps_gradients_through_forward_and_backward():
    single = estimate_memory(_config(), world_size=1, device_type="cpu")
    accumulating = estimate_memory(_config(global_batch=4), world_size=1, device_type="cpu")
    assert accumulating.moment("loss").nbytes - single.moment("loss").nbytes == single.gradients
    assert accumulating.moment("optimizer step").nbytes == single.moment("optimizer step").nbytes


def test_cpu_offload_moves_states_off_the_device():
    on_device = estimate_memory(_config(n_layers=None), world_size=2, device_type="cuda")
    offload = estimate_memory(_config(n_layers=None, fsdp_cpu_offload=True), world_size=2, device_type="cuda")
    resident = on_device.parameters + on_device.optimizer_states + on_device.gradients
    assert on_device.moment("optimizer step").nbytes - offload.moment("optimizer step").nbytes == resident
    assert offload.parameters == on_device.parameters  # still reported, as host memory


def test_cuda_context_counts_only_on_cuda():
    cuda = estimate_memory(_config(), world_size=1, device_type="cuda")
    cpu = estimate_memory(_config(), world_size=1, device_type="cpu")
    assert cuda.total - cuda.peak_allocated == CUDA_CONTEXT_BYTES
    assert cpu.total == cpu.peak_allocated


def test_bad_selective_option_names_the_field():
    with pytest.raises(ValueError, match=r"activation_checkpoint.selective_option='x'.*positive integer"):
        estimate_memory(_config(ac="selective", selective_option="x"), world_size=1, device_type="cpu")


def test_layout_errors_come_from_parallel_dims():
    with pytest.raises(ValueError, match=r"must equal the world size 3"):
        estimate_memory(_config(dp_shard=2), world_size=3, device_type="cpu")


def test_text_lists_every_term_and_reads_the_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _config()
    text = estimate_memory_text(launch_run(cfg))
    est = estimate_memory(cfg, world_size=2, device_type="cpu")
    assert "FSDP 2 (world size 2)" in text
    for term in est.terms:
        assert term.name in text and f"{term.nbytes:,}" in text
    assert f"{est.peak_allocated:,}" in text and "<- peak" in text
    assert "total per device" not in text  # a CPU job: no CUDA context


def test_ngpu_sizes_a_cuda_job_even_on_a_machine_without_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NGPU", "2")
    cfg = _config()
    text = estimate_memory_text(launch_run(cfg))
    est = estimate_memory(cfg, world_size=2, device_type="cuda")
    assert text.startswith("memory estimate per rank: FSDP 2 (world size 2), cuda\n")
    assert f"{est.total:,}" in text  # CUDA context included


@pytest.mark.parametrize("fast_bf16, param_bytes", [(True, 2), (False, 4)])
def test_estimate_and_trainer_agree_on_auto_precision_on_every_cpu_kind(monkeypatch, fast_bf16, param_bytes):
    """'auto' is resolved once (resolve_run) for both: bfloat16 where oneDNN has bf16 kernels, else float32."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: fast_bf16)
    cfg = _config(param_dtype="auto")
    run = resolve_run(cfg, world_size=1, device_type="cpu")
    assert run.precision.param_bytes == param_bytes
    assert cfg.precision.build(device="cpu").param_dtype == run.precision.param_dtype
    text = estimate_memory_text(run)
    assert f"{param_bytes}-byte compute" in text
    explicit = estimate_memory(_config(param_dtype="bfloat16" if fast_bf16 else "float32"), world_size=1,
                               device_type="cpu")
    assert estimate_memory(cfg, world_size=1, device_type="cpu").peak_allocated == explicit.peak_allocated


def test_microbatches_that_do_not_divide_are_an_error_for_the_estimate_as_for_the_trainer():
    with pytest.raises(ValueError, match=r"training.global_batch_size=5 must be a multiple of training.local_batch_size "
                                         r"x data-parallel degree = 2 x 1 = 2; use 4 or -1"):
        estimate_memory(_config(global_batch=5), world_size=1, device_type="cpu")
