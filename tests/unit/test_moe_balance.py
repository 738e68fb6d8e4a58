"""Load balancing: the expert-bias update (aux-loss-free) and the sequence-level auxiliary loss."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from models.common.moe.hooks import set_aux_loss_scale, update_expert_biases
from models.common.moe.layer import MoE, MoEArgs
from models.common.moe.load_balance import expert_bias_delta, sequence_aux_loss

DIM, HIDDEN, EXPERTS = 8, 8, 4


def test_bias_delta_is_a_centred_sign_step():
    delta = expert_bias_delta(torch.tensor([10.0, 2.0, 2.0, 2.0]), rate=0.01)
    # sign(mean 4 - load) = [-1, 1, 1, 1], centred by its mean 0.5.
    torch.testing.assert_close(delta, torch.tensor([-0.015, 0.005, 0.005, 0.005]), rtol=0, atol=1e-9)
    assert expert_bias_delta(torch.tensor([3.0, 3.0, 3.0, 3.0]), rate=0.01).abs().max() == 0


def _collapsed_moe(rate: float) -> MoE:
    """A router that sends every token to expert 0 (top-1): its gate row reads feature 0, which every token
    holds at >= 1 with weight 3; the other rows are small random weights, so experts 1-3 differ per token."""
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=1, hidden_dim=HIDDEN, bias_update_rate=rate))
    moe.init_weights(out_proj_std=0.02)
    with torch.no_grad():
        moe.router.gate.weight.copy_(0.3 * torch.randn(EXPERTS, DIM, generator=torch.Generator().manual_seed(3)))
        moe.router.gate.weight[:, 0] = torch.tensor([3.0, 0.0, 0.0, 0.0])
    return moe


def _tokens(n: int = 64) -> torch.Tensor:
    x = torch.randn(1, n, DIM, generator=torch.Generator().manual_seed(0))
    x[..., 0] = 1.0 + 0.5 * x[..., 0].abs()  # expert 0 always wins without a bias
    return x


def test_bias_update_moves_a_collapsed_router_toward_balance():
    moe = _collapsed_moe(rate=0.05)
    x = _tokens()
    moe(x)
    assert moe.tokens_per_expert.tolist() == [64.0, 0.0, 0.0, 0.0]
    max_loads = []
    for _ in range(30):
        moe.update_expert_bias()
        assert moe.tokens_per_expert.abs().max() == 0  # the update consumes the step's counts
        moe(x)
        max_loads.append(float(moe.tokens_per_expert.max()))
    assert float(moe.expert_bias[0]) < 0 < float(moe.expert_bias[1:].min())
    assert abs(float(moe.expert_bias.sum())) < 1e-6  # centred
    # Collapsed at first (max / mean load 4): a sign update at rate 0.05 first needs ~8 steps to overcome
    # the gate's margin, then oscillates around balance (measured: max load 33-34 of 64 tokens from step 9).
    assert max(max_loads[-10:]) <= 40.0


def test_bias_leaves_the_combine_weights_alone():
    moe = _collapsed_moe(rate=0.05)
    x = _tokens(8)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([-1.0, 1.0, 0.0, 0.0]))  # every token now goes to expert 1
    routing = moe.router(x.view(-1, DIM), moe.expert_bias)
    assert routing.experts.unique().tolist() == [1]
    # top-1 with normalisation: weight 1 whatever the bias; without it, expert 1's unbiased score.
    assert torch.equal(routing.weights, torch.ones(8, 1))
    raw = torch.softmax(x.view(-1, DIM) @ moe.router.gate.weight.T, -1)[:, 1:2]
    unnormalised = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=1, hidden_dim=HIDDEN, norm_topk_prob=False))
    unnormalised.router.load_state_dict(moe.router.state_dict())
    torch.testing.assert_close(unnormalised.router(x.view(-1, DIM), moe.expert_bias).weights, raw, rtol=0, atol=1e-7)


def test_bias_is_a_checkpointed_float32_buffer_and_counts_are_not():
    moe = _collapsed_moe(rate=0.05).to(torch.bfloat16)
    moe.init_weights(out_proj_std=0.02)
    assert moe.expert_bias.dtype == torch.float32
    state = moe.state_dict()
    assert "expert_bias" in state and "tokens_per_expert" not in state


def test_no_counting_in_eval_or_without_a_rate():
    moe = _collapsed_moe(rate=0.05).eval()
    moe(_tokens())
    assert moe.tokens_per_expert.abs().max() == 0
    off = _collapsed_moe(rate=0.0)
    off(_tokens())
    off.update_expert_bias()
    assert off.tokens_per_expert.abs().max() == 0 and off.expert_bias.abs().max() == 0


def test_activation_checkpointing_counts_each_token_once():
    moe = _collapsed_moe(rate=0.05)
    x = _tokens().requires_grad_()
    out = checkpoint(moe, x, use_reentrant=False)
    out.sum().backward()  # recomputes the forward
    assert moe.tokens_per_expert.tolist() == [64.0, 0.0, 0.0, 0.0]


def test_aux_loss_under_activation_checkpointing_has_the_plain_gradient():
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, aux_loss_coeff=0.1))
    moe.init_weights(out_proj_std=0.02, router_std=0.5)
    x = torch.randn(2, 8, DIM)
    grads = []
    for wrap in (lambda f, x: f(x), lambda f, x: checkpoint(f, x, use_reentrant=False)):
        moe.zero_grad()
        out = wrap(moe, x)
        out.sum().backward()  # with the balance loss the output carries
        grads.append(moe.router.gate.weight.grad.clone())
    # The recomputation repeats the same ops on the same values: bitwise equal gradients.
    assert torch.equal(grads[1], grads[0])


def test_aux_loss_on_a_hand_computed_case():
    # One sequence of 2 tokens, 2 experts, top-1. Scores [[0.75, 0.25], [0.5, 0.5]]; both pick expert 0.
    scores = torch.tensor([[[0.75, 0.25], [0.5, 0.5]]])
    experts = torch.tensor([[[0], [0]]])
    # f = E / (k S) * counts = 2 / 2 * [2, 0] = [2, 0]; P = mean scores = [0.625, 0.375]; sum f P = 1.25.
    assert float(sequence_aux_loss(scores, experts, 2)) == pytest.approx(1.25, abs=1e-7)
    # Sigmoid-style scores are normalised per token first: doubling them changes nothing.
    assert float(sequence_aux_loss(2 * scores, experts, 2)) == pytest.approx(1.25, abs=1e-7)
    # A balanced router: f = [1, 1], P = [0.5, 0.5] -> 1; the loss is per sequence, averaged over the batch.
    balanced = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    two = sequence_aux_loss(torch.cat([scores, balanced]), torch.cat([experts, torch.tensor([[[0], [1]]])]), 2)
    assert float(two) == pytest.approx((1.25 + 1.0) / 2, abs=1e-7)


def _aux_only_gate_grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The routers' gradients from the balance losses alone: the output's own gradient is zero."""
    model.zero_grad()
    (model(x) * 0).sum().backward()
    return [layer.router.gate.weight.grad.clone() for layer in model]


def test_each_layer_adds_its_weighted_aux_loss_gradient_times_the_scale():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=HIDDEN, aux_loss_coeff=0.01)
    model = torch.nn.Sequential(MoE(DIM, args), MoE(DIM, args))
    for layer in model:
        layer.init_weights(out_proj_std=0.02, router_std=0.5)
    x = torch.randn(2, 6, DIM)
    # The reference: each layer's coefficient-weighted loss differentiated by hand, on the layer's input.
    expected = []
    h = x
    for layer in model:
        layer.zero_grad()
        r = layer.router(h.detach().view(-1, DIM))
        (0.01 * sequence_aux_loss(r.scores.view(2, 6, -1), r.experts.view(2, 6, -1), EXPERTS)).backward()
        expected.append(layer.router.gate.weight.grad.clone())
        h = layer(h).detach()
    # Layer 1's balance loss reaches layer 0's router through layer 1's input too: only the last layer's
    # gradient is its own loss alone. Compared on each layer fed alone.
    for layer, want in zip(model, expected, strict=True):
        single = torch.nn.Sequential(layer)
        layer_input = x if layer is model[0] else model[0](x).detach()
        (got,) = _aux_only_gate_grads(single, layer_input)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert want.abs().max() > 0
        set_aux_loss_scale(single, 0.25)  # e.g. 1 / (4 micro-batches): a quarter of the gradient
        (quarter,) = _aux_only_gate_grads(single, layer_input)
        torch.testing.assert_close(quarter, 0.25 * want, rtol=1e-6, atol=0)
        set_aux_loss_scale(single, 1.0)
    model.eval()
    assert all(g.abs().max() == 0 for g in _aux_only_gate_grads(model, x))  # no balance loss in evaluation


def test_update_expert_biases_reaches_every_layer():
    model = torch.nn.Sequential(_collapsed_moe(0.05), _collapsed_moe(0.05))
    model[0](_tokens())
    model[1](_tokens())
    update_expert_biases(model)
    for layer in model:
        assert float(layer.expert_bias[0]) == pytest.approx(-0.075) and layer.tokens_per_expert.sum() == 0
