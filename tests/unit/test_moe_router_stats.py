"""The router metrics: load imbalance, dead experts, bias range and balance loss of each MoE layer, read over the
forwards since the previous read without disturbing the expert-bias update."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.common.moe.layer import MoE, MoEArgs
from models.common.moe.load_balance import sequence_aux_loss
from models.common.moe.router_stats import load_imbalance, router_stats, router_summary

DIM, HIDDEN, EXPERTS = 8, 8, 4


def _model(*layers: MoE) -> nn.Module:
    """A model holding the layers as a family does: layers.<i>.moe."""
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Module() for i in range(len(layers))})
    for i, layer in enumerate(layers):
        model.layers[str(i)].moe = layer
    return model


def _moe(**args) -> MoE:
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, hidden_dim=HIDDEN, **args))
    moe.init_weights(out_proj_std=0.02)
    return moe


def _collapsed_moe(**args) -> MoE:
    """Every token goes to expert 0 (top-1): its gate row reads feature 0, which every token holds at >= 1
    (see test_moe_balance)."""
    moe = _moe(top_k=1, **args)
    with torch.no_grad():
        moe.router.gate.weight.copy_(0.3 * torch.randn(EXPERTS, DIM, generator=torch.Generator().manual_seed(3)))
        moe.router.gate.weight[:, 0] = torch.tensor([3.0, 0.0, 0.0, 0.0])
    return moe


def _tokens(n: int = 64) -> torch.Tensor:
    x = torch.randn(1, n, DIM, generator=torch.Generator().manual_seed(0))
    x[..., 0] = 1.0 + 0.5 * x[..., 0].abs()
    return x


def _read(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    return {tag: float(value) for tag, value in stats.items()}


def test_imbalance_and_dead_share_of_a_hand_made_load_vector():
    # mean 2, max 6 -> 3; two of four experts got nothing. Exact in float32 (small integers and their ratios).
    imbalance, dead = load_imbalance(torch.tensor([6, 2, 0, 0]))
    assert (float(imbalance), float(dead)) == (3.0, 0.5)
    assert [float(v) for v in load_imbalance(torch.tensor([5, 5, 5, 5]))] == [1.0, 0.0]
    assert [float(v) for v in load_imbalance(torch.zeros(4, dtype=torch.int64))] == [0.0, 1.0]  # nothing routed


def test_layer_tags_aggregates_and_summary_from_planted_counts():
    first, second = _moe(top_k=2), _moe(top_k=2, bias_update_rate=0.01)
    first.routed_tokens.copy_(torch.tensor([6, 2, 0, 0]))  # imbalance 3, dead 2/4
    second.routed_tokens.copy_(torch.tensor([3, 3, 1, 1]))  # imbalance 1.5, dead 0
    second.expert_bias.copy_(torch.tensor([-0.5, 0.25, 0.125, 0.125]))
    values = _read(router_stats(_model(first, second)))
    assert values == {
        "moe/layers.0/imbalance": 3.0, "moe/layers.0/dead_share": 0.5,
        "moe/layers.1/imbalance": 1.5, "moe/layers.1/dead_share": 0.0,
        "moe/layers.1/bias_min": -0.5, "moe/layers.1/bias_max": 0.25,  # only the layer that uses the bias
        "moe/imbalance_max": 3.0, "moe/dead_share": 0.25,  # 2 of the 8 experts of both layers
    }
    assert router_summary(values) == "moe imb 3.00 (layers.0) dead 0.25"
    # Reading starts a new interval: nothing was routed since.
    assert _read(router_stats(_model(first, second)))["moe/imbalance_max"] == 0.0
    assert router_stats(_model()) == {} and router_summary({}) is None


def test_a_collapsed_router_shows_full_imbalance_and_the_bias_brings_it_down():
    moe = _collapsed_moe(bias_update_rate=0.05)
    model, x = _model(moe), _tokens()
    moe(x)
    values = _read(router_stats(model))
    # Every token to one expert: max / mean = num_experts, every other expert dead; the bias has not moved yet.
    assert values["moe/layers.0/imbalance"] == EXPERTS
    assert values["moe/layers.0/dead_share"] == (EXPERTS - 1) / EXPERTS
    assert values["moe/layers.0/bias_min"] == values["moe/layers.0/bias_max"] == 0.0
    # Reading the metrics leaves the counts of the bias update alone.
    assert moe.tokens_per_expert.tolist() == [64.0, 0.0, 0.0, 0.0]

    history = []
    for _ in range(30):
        moe.update_expert_bias()
        moe(x)
        history.append(_read(router_stats(model)))
    last = history[-1]
    # The bias responds: the overloaded expert's goes down, the idle ones' up (centred sign steps of 0.05).
    assert last["moe/layers.0/bias_min"] == pytest.approx(float(moe.expert_bias[0]), abs=0)
    assert last["moe/layers.0/bias_min"] < 0 < last["moe/layers.0/bias_max"]
    # And the imbalance with it: from 4 to <= 40 / 16 = 2.5 over the last 10 steps (measured in test_moe_balance:
    # max load 33-34 of 64 tokens from step 9 on), with every expert receiving tokens by then.
    assert max(h["moe/layers.0/imbalance"] for h in history[-10:]) <= 2.5
    assert history[-1]["moe/layers.0/dead_share"] < (EXPERTS - 1) / EXPERTS


def test_the_interval_spans_bias_updates_and_micro_batches():
    moe = _collapsed_moe(bias_update_rate=0.05)
    model = _model(moe)
    moe(_tokens(16))
    moe.update_expert_bias()  # zeroes the bias update's counts, not the metrics'
    moe(_tokens(16))
    assert moe.routed_tokens.tolist() == [32, 0, 0, 0]
    assert _read(router_stats(model))["moe/layers.0/imbalance"] == EXPERTS


def test_the_balance_loss_is_its_mean_per_forward():
    moe = _moe(top_k=2, aux_loss_coeff=0.1)
    model = _model(moe)
    expected = []
    for seed in (0, 1):
        x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(seed))
        moe(x)
        with torch.no_grad():
            routing = moe.router(x.reshape(-1, DIM))
        expected.append(0.1 * sequence_aux_loss(routing.scores.view(2, 8, -1), routing.experts.view(2, 8, -1), EXPERTS))
    values = _read(router_stats(model))
    # The same float32 ops in the same order, averaged over the two forwards: within float32 rounding of the mean.
    assert values["moe/aux_loss"] == pytest.approx(float(torch.stack(expected).mean()), rel=1e-6)
    assert "aux" in router_summary(values)


def test_activation_checkpointing_counts_each_token_and_loss_once():
    moe = _collapsed_moe(aux_loss_coeff=0.1)
    x = _tokens().requires_grad_()
    checkpoint(moe, x, use_reentrant=False).sum().backward()  # recomputes the forward
    assert moe.routed_tokens.tolist() == [64, 0, 0, 0]
    assert float(moe.aux_loss_window[1]) == 1.0


def test_no_counting_in_eval():
    moe = _collapsed_moe().eval()
    moe(_tokens())
    assert moe.routed_tokens.abs().max() == 0 and moe.aux_loss_window.abs().max() == 0
