"""MoE planning: total / active parameters and FLOPs per token against hand counts of the published
Qwen3-MoE shapes, the routed activations of an MoE layer against autograd's saved tensors, and the
expert bytes per rank under expert parallelism."""
from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from models import get_model_spec
from models.common.moe.layer import MoE, MoEArgs
from models.llama3 import Transformer
from models.qwen3_moe import Qwen3MoeModel, Qwen3MoeModelArgs
from torchtitan_lite.config.sections import ModelConfig, ParallelismConfig, TrainingConfig
from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.memory.activations import ActivationSetup, block_plan, block_saved_bytes
from torchtitan_lite.memory.estimate import estimate_memory
from torchtitan_lite.memory.layout import model_layout
from torchtitan_lite.memory.routed import (
    EP_RECEIVE_HEADROOM,
    RoutedSetup,
    all_to_all_bytes,
    moe_backward_working_bytes,
    moe_saved_bytes,
)
from torchtitan_lite.resolved_run import resolve_run
from torchtitan_lite.trainer import Trainer


def _qwen3_moe_by_hand(dim, n_layers, n_heads, n_kv_heads, head_dim, vocab, experts, top_k, hidden):
    """(total, active) of a Qwen3-MoE from its config.json fields, counted matrix by matrix."""
    attention = dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim + n_heads * head_dim * dim
    norms = 2 * head_dim + 2 * dim  # q_norm, k_norm, attention_norm, ffn_norm
    router = experts * dim
    one_expert = 3 * dim * hidden  # w1, w3: hidden x dim; w2: dim x hidden
    block = attention + norms + router + experts * one_expert
    outside = 2 * vocab * dim + dim  # untied embedding and output, final norm
    total = n_layers * block + outside
    return total, total - n_layers * (experts - top_k) * one_expert


# Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json; the names round down the counts (30.5B / 3.3B,
# 235B / 22B), so the published figures are the counts truncated to their last digit.
PUBLISHED = {
    "30B-A3B": ((2048, 48, 32, 4, 128, 151936, 128, 8, 768), (30.5, 3.3), 1e8),
    "235B-A22B": ((4096, 94, 64, 4, 128, 151936, 128, 8, 1536), (235, 22), 1e9),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_total_and_active_parameters_of_the_published_flavors(flavor):
    shape, (total_b, active_b), digit = PUBLISHED[flavor]
    total, active = _qwen3_moe_by_hand(*shape)
    with torch.device("meta"):
        model = get_model_spec("qwen3_moe").model_cls(get_model_spec("qwen3_moe").flavors[flavor])
    counts = model.param_counts()
    assert (counts.total, counts.active) == (total, active)
    assert math.floor(total / digit) * digit == pytest.approx(total_b * 1e9)
    assert math.floor(active / digit) * digit == pytest.approx(active_b * 1e9)
    # MFU counts 6 x the active matmul parameters (all but the embedding lookup) + the attention term.
    dim, n_layers, n_heads, _, head_dim, vocab = shape[:6]
    assert model.flops_per_token(4096) == 6 * (active - vocab * dim) + 12 * n_layers * n_heads * head_dim * 4096


def test_dense_model_is_all_active():
    with torch.device("meta"):
        model = Transformer(get_model_spec("llama3").flavors["debug"])
    counts = model.param_counts()
    assert counts.active == counts.total == model.num_params()
    assert counts.routed_experts == 0


# --------------------------------------------------------------------------------------------------
# Routed activations: the saved set of one MoE layer against autograd


def _saved_bytes(module, x, *, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in ``module``'s forward, parameters excluded."""
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("shared", [0, 1], ids=["routed-only", "shared-expert"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("precision", ["float32", "bf16-params", "bf16-autocast"])
def test_moe_saved_bytes_match_autograd_saved_tensors(shared, score_func, precision):
    dim, batch, seq = 64, 2, 24
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=32, score_func=score_func, num_shared_experts=shared)
    layer = MoE(dim, args)
    layer.init_weights(0.02)
    # bf16-params: parameters cast as FSDP's mixed-precision policy does.
    if precision == "bf16-params":
        layer = layer.to(torch.bfloat16)
    x = torch.randn(batch, seq, dim, dtype=torch.bfloat16 if precision == "bf16-params" else torch.float32,
                    requires_grad=True)
    autocast = precision == "bf16-autocast"
    # Autocast's casts of nn.Linear weights (the shared experts') are the estimate's own term, as for
    # dense blocks; the grouped experts' weight casts are not cached by autocast, so they count here.
    linear_casts = sum(p.numel() * 2 for p in layer.shared_experts.parameters()) if autocast and shared else 0
    measured = _saved_bytes(layer, x, autocast=autocast) - linear_casts
    facts = args.facts(layers=(0,))
    setup = RoutedSetup(num_experts=facts.num_experts, top_k=facts.top_k, hidden=facts.expert_hidden_dim,
                        shared_hidden=facts.shared_hidden_dim, layers=frozenset(facts.layers))
    # Exact: the formula lists every saved storage (no aux loss here: its few small tensors are not modelled).
    estimated = moe_saved_bytes(setup, tokens=batch * seq, dim=dim, compute_bytes=4 if precision == "float32" else 2,
                                autocast=precision == "bf16-autocast")
    assert sum(estimated.values()) == measured


def test_expert_parallel_receives_with_headroom_and_exchanges_both_ways():
    r = RoutedSetup(num_experts=128, top_k=8, hidden=1536, shared_hidden=0, layers=frozenset({0}), ep=8)
    assert (r.sent_rows(4096), r.received_rows(4096)) == (32768, math.ceil(32768 * EP_RECEIVE_HEADROOM))
    assert all_to_all_bytes(r, tokens=4096, dim=4096, compute_bytes=2) == (32768 + 40960) * 4096 * 2
    no_ep = RoutedSetup(num_experts=128, top_k=8, hidden=1536, shared_hidden=0, layers=frozenset({0}))
    assert all_to_all_bytes(no_ep, tokens=4096, dim=4096, compute_bytes=2) == 0
    assert no_ep.received_rows(4096) == 32768


# --------------------------------------------------------------------------------------------------
# Expert bytes per rank under EP


def _config(flavor: str = "235B-A22B", *, ep: int = 1, dp_shard: int = -1) -> Trainer.Config:
    return Trainer.Config(model=ModelConfig(name="qwen3_moe", flavor=flavor),
                          training=TrainingConfig(seq_len=4096, local_batch_size=1),
                          parallelism=ParallelismConfig(ep=ep, dp_shard=dp_shard))


def test_ep_splits_experts_then_fsdp_shards_them_over_the_ranks_left():
    run = resolve_run(_config(ep=8), world_size=64, device_type="cuda")
    layout = model_layout(run)
    w1 = next(p for p in layout.params if p.fqn == "layers.0.moe.experts.w1")
    wq = next(p for p in layout.params if p.fqn == "layers.0.attention.wq.weight")
    # 128 experts / EP 8 = 16 per rank, then FSDP over dp_shard / ep = 8 ranks: 2 experts' rows each.
    assert w1.routed_expert and w1.tp_shape == (16, 1536, 4096) and w1.local_shape == (2, 1536, 4096)
    # What FSDP gathers for one block: its 16 local experts, not all 128.
    gathered = sum(p.tp_numel for p in layout.unit_params("layers.0") if p.routed_expert)
    assert gathered == 3 * 16 * 1536 * 4096
    # Everything else is sharded over all 64 dp_shard ranks as without EP.
    assert not wq.routed_expert and wq.local_shape == (8192 // 64, 4096)


def test_ep_gathers_a_block_of_local_experts_only():
    """At rest a rank holds the same expert bytes with or without EP (the degrees divide); FSDP all-gathers
    E / ep experts per block instead of E."""
    fsdp = estimate_memory(_config(), world_size=64, device_type="cuda")
    ep8 = estimate_memory(_config(ep=8), world_size=64, device_type="cuda")
    assert ep8.parameters == fsdp.parameters
    assert ep8["  expert parameters"] == fsdp["  expert parameters"] == 94 * 3 * 128 * 1536 * 4096 * 4 // 64
    # The largest gathered set without EP is two blocks (computing + prefetched), each with all 128
    # experts in bf16 (param_dtype on CUDA); with EP 8 it holds 16 experts per block.
    block = 3 * 128 * 1536 * 4096
    assert fsdp["FSDP gathered params"] >= 2 * block * 2
    assert ep8["FSDP gathered params"] < 2 * (block // 8) * 2 + 2 * 151936 * 4096 * 2  # + the head's output
    assert ep8["all-to-all buffers"] == (32768 + 40960) * 4096 * 2 and fsdp["all-to-all buffers"] == 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_moe_block_keeps_what_the_plan_says(mode):
    """Full AC keeps the block input; the op policy also keeps wq's and wv's outputs, SDPA's and the router
    gate's float32 logits (the 5th matmul of the block), not the grouped expert GEMMs."""
    args = Qwen3MoeModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128, max_seq_len=64,
                             moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32))
    model = Qwen3MoeModel(args)
    apply_ac(model.layers, mode, "op")
    batch, seq = 2, 32
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model.layers["0"](x, model.rope.cache)
    alive = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    facts = args.moe_facts()
    setup = ActivationSetup(
        tokens=batch * seq, dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
        ffn_dim=0, vocab_size=args.vocab_size, n_layers=1, tp=1, sequence_parallel=False, loss_parallel=False,
        compute_bytes=4, residual_bytes=4, autocast=False, device_type="cpu", compiled_loss=False,
        moe=RoutedSetup(num_experts=8, top_k=2, hidden=32, shared_hidden=0, layers=frozenset(facts.layers)),
    )
    kept, recompute = block_plan(setup, mode, "op")[0]
    # As for dense blocks (tests/unit/test_memory_estimate.py): the input was allocated before profiling;
    # tolerance 1 KiB for the checkpoint's small bookkeeping tensors.
    input_bytes = x.numel() * x.element_size()
    assert abs(alive - out.numel() * out.element_size() - (kept - input_bytes)) < 1024
    assert recompute > 0 and "router" in block_saved_bytes(setup, 0) and "swiglu" not in block_saved_bytes(setup, 0)


def test_active_parameters_are_counted_through_activation_checkpoint_wrappers():
    """The trainer reads flops_per_token of the parallelized model, whose blocks AC has wrapped
    (layers.<i>._checkpoint_wrapped_module.moe.experts...): MFU must still skip the idle experts."""
    spec = get_model_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["debug"])
    before = model.param_counts()
    apply_ac(model.layers, "full")
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    assert model.param_counts() == before and before.active < before.total


def test_low_precision_experts_add_an_input_copy_and_one_gemms_float8_operands():
    """torchao's FP8 / MXFP8 grouped GEMMs save their high-precision input each (no shared routed rows)
    and hold their float8 operands only while they run."""
    base = dict(num_experts=128, top_k=8, hidden=1536, shared_hidden=0, layers=frozenset({0}), ep=8)
    bf16, fp8 = RoutedSetup(**base), RoutedSetup(**base, float8_experts=True)
    kw = dict(tokens=4096, dim=4096, compute_bytes=2)
    saved = {name: sum(moe_saved_bytes(r, **kw, autocast=False).values()) for name, r in (("bf16", bf16), ("fp8", fp8))}
    assert saved["fp8"] - saved["bf16"] == 40960 * 4096 * 2
    working = moe_backward_working_bytes(fp8, **kw) - moe_backward_working_bytes(bf16, **kw)
    assert working == 40960 * 4096 + 16 * 1536 * 4096


def test_blockwise_experts_add_their_128_row_padding_and_float32_operands():
    """Blockwise experts (emulated) pad every token group to 128 rows (the buffers hold E x 127 rows more) in the
    inputs of w1, w3 and w2, and with float32 scales multiply float32 dequantized operands: the token operands of
    one GEMM and two float32 tensors of the local experts' weight size (power-of-2 scales: compute-dtype ones)."""
    base = dict(num_experts=128, top_k=8, hidden=1536, shared_hidden=0, layers=frozenset({0}), ep=8, float8_experts=True)
    fp8, blockwise = RoutedSetup(**base), RoutedSetup(**base, blockwise_experts=True, float32_expert_gemms=True)
    kw = dict(tokens=4096, dim=4096, compute_bytes=2)
    assert blockwise.padding_rows == 16 * 127 and fp8.padding_rows == 0
    saved = {name: sum(moe_saved_bytes(r, **kw, autocast=False).values()) for name, r in (("fp8", fp8),
                                                                                        ("blockwise", blockwise))}
    assert saved["blockwise"] - saved["fp8"] == 16 * 127 * (2 * 4096 + 1536) * 2
    working = moe_backward_working_bytes(blockwise, **kw) - moe_backward_working_bytes(fp8, **kw)
    assert working == (4 * ((40960 + 16 * 127) * (4096 + 1536) + 2 * 16 * 1536 * 4096)
                       - (40960 * 4096 + 16 * 1536 * 4096))
    power_of_2 = RoutedSetup(**base, blockwise_experts=True)
    working = moe_backward_working_bytes(power_of_2, **kw) - moe_backward_working_bytes(fp8, **kw)
    assert working == (2 * ((40960 + 16 * 127) * (4096 + 1536) + 2 * 16 * 1536 * 4096)
                       - (40960 * 4096 + 16 * 1536 * 4096))
