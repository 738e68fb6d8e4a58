"""Token-choice router: top-k, score functions, normalisation, route scale, float32 gate, and an expert bias
that changes which experts are chosen but never the weights they are combined with."""
import pytest
import torch

from models.common.moe.router import TokenChoiceRouter

DIM, EXPERTS = 4, 5


def _router(**kwargs) -> TokenChoiceRouter:
    router = TokenChoiceRouter(DIM, EXPERTS, kwargs.pop("top_k", 2), **kwargs)
    # Gate = identity on the first 4 experts, expert 4 reads nothing: logits are x padded with a 0.
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[:DIM].copy_(torch.eye(DIM))
    return router


X = torch.tensor([[3.0, 1.0, 2.0, -1.0]])  # logits [3, 1, 2, -1, 0]


def test_softmax_top_k_with_normalised_weights():
    r = _router()(X)
    logits = torch.tensor([3.0, 1.0, 2.0, -1.0, 0.0])
    probs = torch.softmax(logits, -1)
    assert r.experts.tolist() == [[0, 2]]
    torch.testing.assert_close(r.scores[0], probs, rtol=0, atol=1e-7)
    expected = probs[[0, 2]] / probs[[0, 2]].sum()
    torch.testing.assert_close(r.weights[0], expected, rtol=0, atol=1e-7)
    assert abs(float(r.weights.sum().detach()) - 1.0) < 1e-6


def test_without_normalisation_the_weights_are_the_scores():
    r = _router(norm_topk_prob=False)(X)
    probs = torch.softmax(torch.tensor([3.0, 1.0, 2.0, -1.0, 0.0]), -1)
    torch.testing.assert_close(r.weights[0], probs[[0, 2]], rtol=0, atol=1e-7)


def test_sigmoid_scores_and_route_scale():
    r = _router(score_func="sigmoid", norm_topk_prob=False, route_scale=2.5)(X)
    torch.testing.assert_close(r.scores[0], torch.sigmoid(torch.tensor([3.0, 1.0, 2.0, -1.0, 0.0])), rtol=0, atol=1e-7)
    torch.testing.assert_close(r.weights[0], 2.5 * torch.sigmoid(torch.tensor([3.0, 2.0])), rtol=0, atol=1e-6)
    normalised = _router(score_func="sigmoid", route_scale=2.5)(X)
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(normalised.weights[0], 2.5 * s / s.sum(), rtol=0, atol=1e-6)


def test_top_k_ordering_and_k():
    r = _router(top_k=3)(X)
    assert r.experts.tolist() == [[0, 2, 1]]
    assert r.weights.shape == (1, 3)


def test_bias_changes_the_selection_not_the_weights():
    router = _router(norm_topk_prob=False)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])  # expert 4 (score 0.03) is pushed above expert 2 (0.24)
    plain, biased = router(X), router(X, expert_bias=bias)
    assert plain.experts.tolist() == [[0, 2]]
    assert biased.experts.tolist() == [[4, 0]]  # ordered by biased score: 0.03 + 1 > 0.64
    probs = torch.softmax(torch.tensor([3.0, 1.0, 2.0, -1.0, 0.0]), -1)
    # Combine weights are the unbiased scores of the chosen experts.
    torch.testing.assert_close(biased.weights[0], probs[[4, 0]], rtol=0, atol=1e-7)
    torch.testing.assert_close(biased.scores, plain.scores, rtol=0, atol=0)


def test_gate_runs_in_float32_under_autocast_and_for_bf16_inputs():
    router = _router()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router(X)
    assert r.scores.dtype == torch.float32 and r.weights.dtype == torch.float32
    # 1 + 2^-10 is not a bf16 number: a bf16 gate would see logits 1 and 1 (a tie broken by index).
    x = torch.tensor([[1.0, 1.0 + 2 ** -10, -5.0, -5.0]])
    assert _router(top_k=1)(x).experts.tolist() == [[1]]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="score_func='relu' must be one of softmax, sigmoid"):
        TokenChoiceRouter(DIM, EXPERTS, 2, score_func="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k=6 must be between 1 and num_experts=5"):
        TokenChoiceRouter(DIM, EXPERTS, 6)


def test_moe_args_refuse_bad_values_by_name():
    from models.common.moe.layer import MoEArgs

    with pytest.raises(ValueError, match="top_k=9 must not exceed num_experts=8"):
        MoEArgs(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="route_scale=0 must be positive"):
        MoEArgs(route_scale=0)
    with pytest.raises(ValueError, match=r"bias_update_rate=-0.001 must be >= 0 \(0 turns it off\)"):
        MoEArgs(bias_update_rate=-1e-3)
    with pytest.raises(ValueError, match="hidden_dim=0 must be a positive integer"):
        MoEArgs(hidden_dim=0)


def _grouped_router(**kwargs) -> TokenChoiceRouter:
    router = TokenChoiceRouter(8, 8, 2, score_func="sigmoid", norm_topk_prob=False, **kwargs)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(8))
    return router


# Groups of two: {0, 1} holds the best expert but a useless partner (sum of its two sigmoid scores 1.0), {2, 3}
# and {4, 5} hold strong pairs (1.96 and 1.95), {6, 7} nothing.
GROUPED_X = torch.tensor([[5.0, -5.0, 4.0, 3.9, 3.8, 3.7, -5.0, -5.0]])


def test_group_limited_routing_picks_experts_only_from_the_best_groups():
    assert _grouped_router()(GROUPED_X).experts.tolist() == [[0, 2]]  # no groups: the global top-2
    r = _grouped_router(num_groups=4, topk_groups=2)(GROUPED_X)
    assert r.experts.tolist() == [[2, 3]]  # expert 0 is the best one, but its group ranks third
    torch.testing.assert_close(r.weights[0], torch.sigmoid(torch.tensor([4.0, 3.9])), rtol=0, atol=1e-7)
    # Three groups kept: group {0, 1} (third) is back, so expert 0 is chosen again.
    assert _grouped_router(num_groups=4, topk_groups=3)(GROUPED_X).experts.tolist() == [[0, 2]]
    # The bias takes part in the group scores and in the choice inside them: lifting both experts of {0, 1} by 1
    # makes it the best group, and expert 1 (score 0.007) is then chosen for its bias.
    bias = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0, 0])
    assert _grouped_router(num_groups=4, topk_groups=2)(GROUPED_X, expert_bias=bias).experts.tolist() == [[0, 1]]


def test_group_settings_are_checked():
    with pytest.raises(ValueError, match="num_groups=3 must be a positive divisor of num_experts=8"):
        _grouped_router(num_groups=3)
    with pytest.raises(ValueError, match="top_k=3 exceeds the 2 experts of topk_groups=1 groups of 2"):
        TokenChoiceRouter(8, 8, 3, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="num_groups=8 leaves 1 expert per group.*at most 4 groups"):
        TokenChoiceRouter(8, 8, 1, num_groups=8, topk_groups=1)
    with pytest.raises(ValueError, match="topk_groups=5 must be between 1 and num_groups=4"):
        _grouped_router(num_groups=4, topk_groups=5)


def test_moe_args_check_the_groups_with_their_own_prefix():
    from models.common.moe.layer import MoEArgs

    with pytest.raises(ValueError, match="^moe args: num_groups=3 must be a positive divisor of num_experts=8$"):
        MoEArgs(num_experts=8, top_k=2, num_groups=3)
    assert MoEArgs(num_experts=8, top_k=2, num_groups=4, topk_groups=2).topk_groups == 2
