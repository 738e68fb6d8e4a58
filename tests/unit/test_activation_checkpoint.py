"""Activation checkpointing: the same numbers as without it, and measurably recomputing in backward."""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.llama3.model import Llama3ModelArgs, Transformer
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.distributed.activation_checkpoint import apply_ac

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
MATMULS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w2, w3
_aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts aten ops by overload packet; steps aside for tensor subclasses so their inner ops count."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented
        self.counts[func._overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def _model(mode: str, option: str = "op", float8: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, fqn: fqn != "output")
    apply_ac(model.layers, mode, option)
    return model


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _backward_ops(model) -> Counter:
    inputs, labels = _batch()
    loss, _ = cross_entropy_sum(model(inputs), labels)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_backward_recomputes_blocks_fully_per_op_or_every_nth():
    mm = {name: _backward_ops(_model(*spec))[_aten.mm] for name, spec in {
        "none": ("none",), "full": ("full",), "op": ("selective", "op"), "every2": ("selective", "2")}.items()}
    # Without checkpointing backward runs two matmuls per Linear (input and weight gradients).
    assert mm["none"] == 2 * (MATMULS_PER_BLOCK * ARGS.n_layers + 1)
    # Full recomputation replays each block up to the last activation backward needs: 6 of its 7
    # matmuls (w2's output only feeds the residual add, which saves nothing, so the replay stops early).
    assert mm["full"] - mm["none"] == (MATMULS_PER_BLOCK - 1) * ARGS.n_layers
    # Per op saves every other matmul output (forward order: wq, wk, wv, wo, w1, w3, w2), so only
    # wk, wo and w3 are recomputed; every 2nd block recomputes one block fully.
    assert mm["op"] - mm["none"] == 3 * ARGS.n_layers
    assert mm["every2"] - mm["none"] == MATMULS_PER_BLOCK - 1
    sdpa = _aten._scaled_dot_product_flash_attention_for_cpu
    assert _backward_ops(_model("full"))[sdpa] == ARGS.n_layers  # attention is recomputed by full ...
    assert _backward_ops(_model("selective", "op"))[sdpa] == 0  # ... and saved per op


def test_per_op_policy_saves_float8_amax_reductions():
    none, op, full = (_backward_ops(_model(*spec, float8=True)) for spec in [("none",), ("selective", "op"), ("full",)])
    amax_ops = (_aten.max, _aten.amax)
    recomputed = lambda counts: sum(counts[o] for o in amax_ops) - sum(none[o] for o in amax_ops)  # noqa: E731
    assert recomputed(full) > 0  # the forward scales are recomputed when nothing is saved ...
    assert recomputed(op) == 0  # ... but not when the amax results are saved
    assert op[_aten._scaled_mm] > none[_aten._scaled_mm]  # float8 matmuls are still partly recomputed


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2"), ("selective", "1")])
def test_losses_and_gradients_equal_no_checkpointing(mode, option):
    reference, model = _model("none"), _model(mode, option)
    assert model.state_dict().keys() == reference.state_dict().keys()  # checkpoints are interchangeable
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(3):
        inputs, labels = _batch(step)
        losses = []
        for m in (reference, model):
            loss, _ = cross_entropy_sum(m(inputs), labels)
            loss.backward()
            losses.append(loss.detach())
        # Recomputation repeats the same float32 kernels on the same inputs; 1e-5 is the stated bound.
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
        ref_grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in reference.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name.replace("_checkpoint_wrapped_module.", "")],
                                       rtol=1e-5, atol=1e-8, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("mode, option, message", [
    ("sometimes", "op", "activation_checkpoint.mode='sometimes' must be 'none', 'full' or 'selective'"),
    ("selective", "ops", "activation_checkpoint.selective_option='ops' must be 'op' or a positive integer N"),
    ("selective", "0", "activation_checkpoint.selective_option='0' must be 'op' or a positive integer N"),
])
def test_bad_settings_are_refused(mode, option, message):
    with pytest.raises(ValueError) as e:
        apply_ac(Transformer(dataclasses.replace(ARGS, n_layers=1)).layers, mode, option)
    assert message in str(e.value)


def test_every_nth_wraps_the_nth_blocks_and_returns_a_description():
    model = Transformer(dataclasses.replace(ARGS, n_layers=4))
    assert apply_ac(model.layers, "selective", "2") == "selective every 2 block(s), full (2/4 blocks)"
    wrapped = [name for name, block in model.layers.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["1", "3"]
    assert apply_ac(copy.deepcopy(model).layers, "none") == "none"


@pytest.mark.parametrize("compiled_tp", [False, True])
def test_selective_contexts_carry_a_cache_hash_so_compiled_blocks_can_be_cached(compiled_tp):
    # torch's AOT-autograd cache bypasses a checkpointed block whose context_fn has no cache_hash: every warm
    # run would then re-trace and re-partition the block although inductor's cache holds its kernels.
    from torch._functorch._aot_autograd.autograd_cache import _get_context_fn_cache_hash

    hashes = set()
    for option in ("op", "1"):
        model = Transformer(ARGS)
        apply_ac(model.layers, "selective", option, compiled_tp=compiled_tp)
        context_fn = model.layers["0"].checkpoint_fn.keywords.get("context_fn")
        if context_fn is None:  # full checkpointing of a block that is not tensor-parallel: no context at all
            continue
        cache_hash = _get_context_fn_cache_hash(context_fn)
        assert isinstance(cache_hash, str) and cache_hash.startswith("torchtitan_lite.")
        hashes.add(cache_hash)
    assert len(hashes) == (2 if compiled_tp else 1)  # the per-op and the attention-saving policies differ
