"""MXFP8 Linears (the mx converter, emulated on CPU) under FSDP 2, TP 2 and FSDP x TP 2x2 on gloo train like
the same MX model on one process: FSDP all-gathers their weights in the parameter dtype, and under TP
DTensor takes each 32-element block whole, also where a TP shard is narrower than a block. Activation
checkpointing (full, selective per-op and every-Nth) recomputes MX exactly."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _llama_steps import Run, layout_results, layout_runs, single_process_results

# float32: the MX casts see the same values in every layout, so only the order of float32 sums differs
# (measured below 2e-7 relative on the first gradients); MX itself moves them ~5% from float32 (measured
# 5.1e-2 at least), so 1e-5 leaves margin on one side and 1e-2 on the other.
LAYOUT_RTOL = 1e-5
MX_EFFECT = 1e-2
# bf16: as the bf16 layout tests (test_parallel_layouts.BF16_RTOL): FSDP casts parameters, the reference
# runs under autocast.
BF16_RTOL = 5e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2_tp2"])
def test_mx_first_gradients_match_single_process_mx_and_differ_from_float32(layout):
    run = layout_runs(layout)["mx_fp32"]
    got, ref = layout_results(layout)["mx_fp32"], single_process_results(run.single_process())
    plain = single_process_results(layout_runs(layout)["fp32"].single_process())
    assert set(got["first_grads"]) == set(ref["first_grads"])
    for name, grad in got["first_grads"].items():
        assert _rel(grad, ref["first_grads"][name]) < LAYOUT_RTOL, name
    # MX really ran in the reference (and so in the layout): every block weight's gradient moved.
    block_weights = [n for n in ref["first_grads"] if n.startswith("layers.") and "norm" not in n]
    assert min(_rel(ref["first_grads"][n], plain["first_grads"][n]) for n in block_weights) > MX_EFFECT


def test_mx_bf16_losses_match_single_process_under_fsdp():
    run = layout_runs("fsdp2")["mx_bf16"]
    got, ref = layout_results("fsdp2")["mx_bf16"], single_process_results(run.single_process())
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True)) < BF16_RTOL


@pytest.mark.parametrize("ac_mode, ac_option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_mx_with_activation_checkpointing_reproduces_mx_without(ac_mode, ac_option):
    plain = Run(mx="mxfp8", steps=2)
    ref = single_process_results(plain)
    got = single_process_results(dataclasses.replace(plain, ac_mode=ac_mode, ac_option=ac_option))
    # The recomputed forward casts the same values with the same per-block scales: identical gradients.
    for name, grad in got["first_grads"].items():
        assert torch.equal(grad, ref["first_grads"][name]), name
    assert got["losses"] == ref["losses"]
