"""Grouped experts and the local dispatcher: torch._grouped_mm against the per-expert loop, empty experts,
and the MoE layer's output against a direct per-token evaluation."""
import pytest
import torch
import torch.nn.functional as F

from models.common.moe.dispatch import LocalTokenDispatcher
from models.common.moe.experts import GroupedExperts
from models.common.moe.layer import MoE, MoEArgs

DIM, HIDDEN, EXPERTS = 16, 24, 4
# float32 GEMMs over the same rows in a different blocking: differences are summation-order rounding of
# outputs up to ~4 in size (measured max 6.0e-8 forward, 1.2e-7 gradients); 1e-5 is ~100x that, and far
# below a wrong expert or a dropped row (differences of order 1).
TOL = 1e-5


def _experts(use_grouped_mm: bool = True) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=use_grouped_mm)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.3)
    return experts


@pytest.mark.parametrize("counts", [[3, 5, 0, 4], [0, 0, 12, 0], [12, 0, 0, 0], [0, 0, 0, 0]])
def test_grouped_equals_loop_forward_and_gradients(counts):
    experts = _experts()
    n = sum(counts)
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad_out = torch.randn(n, DIM, generator=torch.Generator().manual_seed(2))
    counts_t = torch.tensor(counts)

    results = []
    for forward in (experts.grouped_forward, experts.loop_forward):
        experts.zero_grad()
        x.grad = None
        y = forward(x, counts_t)
        (y * grad_out).sum().backward()
        results.append((y.detach(), x.grad.clone(), [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)]))
    (y_g, gx_g, gw_g), (y_l, gx_l, gw_l) = results
    assert y_g.shape == (n, DIM)
    torch.testing.assert_close(y_g, y_l, rtol=0, atol=TOL)
    torch.testing.assert_close(gx_g, gx_l, rtol=0, atol=TOL)
    for a, b in zip(gw_g, gw_l):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    # An expert without tokens gets an exactly zero gradient (not garbage) from both paths.
    for e, c in enumerate(counts):
        if c == 0:
            assert gw_g[0][e].abs().max() == 0 and gw_l[0][e].abs().max() == 0


def test_loop_is_a_per_expert_swiglu():
    experts = _experts(use_grouped_mm=False)
    x = torch.randn(5, DIM)
    y = experts(x, torch.tensor([2, 0, 3, 0]))
    e2 = F.linear(F.silu(F.linear(x[2:], experts.w1[2])) * F.linear(x[2:], experts.w3[2]), experts.w2[2])
    assert torch.equal(y[2:], e2)


def test_grouped_mm_casts_to_the_autocast_dtype():
    experts = _experts()
    x = torch.randn(6, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, torch.tensor([1, 2, 3, 0]))
    assert y.dtype == torch.bfloat16


def test_unaligned_width_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"multiples of 8 .*use_grouped_mm=False"):
        GroupedExperts(16, 20, 4)
    GroupedExperts(16, 20, 4, use_grouped_mm=False)  # the loop has no alignment requirement


def test_dispatch_sorts_by_expert_and_combine_restores_token_order():
    dispatcher = LocalTokenDispatcher(num_experts=3)
    x = torch.arange(4, dtype=torch.float32).unsqueeze(-1).repeat(1, 2)  # token t holds value t
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    rows, counts, handle = dispatcher.dispatch(x, experts)
    assert counts.tolist() == [3, 2, 3]
    # expert 0: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2, 3 (stable: token order kept).
    assert rows[:, 0].tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0], [0.1, 0.9]])
    out = dispatcher.combine(rows * 10, handle, weights)  # every "expert" multiplies by 10
    expected = 10 * x * weights.sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one by one, weighted by its own softmax scores."""
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t, token in enumerate(tokens):
        scores = torch.softmax(moe.router.gate.weight @ token, dim=-1)
        top = torch.topk(scores, moe.args.top_k)
        weights = top.values / top.values.sum()
        for w, e in zip(weights, top.indices):
            out[t] += w * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token)))
    return out.view_as(x)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_moe_layer_matches_a_per_token_evaluation(use_grouped_mm):
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, use_grouped_mm=use_grouped_mm))
    moe.init_weights(out_proj_std=0.2, router_std=0.5)
    x = torch.randn(2, 5, DIM)
    torch.testing.assert_close(moe(x), _per_token_reference(moe, x), rtol=0, atol=TOL)


def test_shared_experts_add_a_dense_swiglu():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, num_shared_experts=2)
    moe = MoE(DIM, args)
    moe.init_weights(out_proj_std=0.2)
    assert moe.shared_experts is not None and moe.shared_experts.w1.weight.shape == (2 * HIDDEN, DIM)
    x = torch.randn(1, 3, DIM)
    routed_only = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN))
    routed_only.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("shared")})
    torch.testing.assert_close(moe(x), routed_only(x) + moe.shared_experts(x), rtol=0, atol=1e-6)


def test_moe_layer_traces_as_one_graph_in_bfloat16():
    """torch.compile(fullgraph=True) of the layer (counts included): no data-dependent shapes or host reads.
    aot_eager runs the traced graph with eager kernels, so the result equals eager up to op-order rounding
    (bf16 outputs of order 0.1: 1e-2 is a few bf16 ulps)."""
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, bias_update_rate=1e-3,
                           aux_loss_coeff=1e-2)).to(torch.bfloat16)
    moe.init_weights(out_proj_std=0.2, router_std=0.5)
    x = torch.randn(2, 8, DIM, dtype=torch.bfloat16)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (out.float() * 0).sum().backward()  # the balance loss's gradient alone reaches the router
    compiled_grad = moe.router.gate.weight.grad.clone()
    assert moe.tokens_per_expert.sum() == 2 * 8 * 2 and compiled_grad.abs().max() > 0
    moe.zero_grad()
    eager = moe(x)
    (eager.float() * 0).sum().backward()
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-2)
    # Gradients of order 3e-4: 2e-5 is a few bf16 ulps (measured equal).
    torch.testing.assert_close(compiled_grad, moe.router.gate.weight.grad, rtol=0, atol=2e-5)
