"""MXFP8 Linears (the mx converter, emulated on CPU) under FSDP 2, TP 2 and FSDP x TP 2x2 on gloo train like
the same MX model on one process: FSDP all-gathers their weights in the parameter dtype, and under TP
DTensor takes each 32-element block whole, also where a TP shard is narrower than a block. Activation
checkpointing (full, selective per-op and every-Nth) recomputes MX exactly."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _llama_steps import Run, Tolerance, check_two_sided, layout_results, layout_runs, single_process_results

# Two-sided, as test_parallel_layouts: each layout is closer to its one-process MX reference than MX is to
# the same run without it, and that run without MX (from the same launch) fails the same tolerance.
# Measured on a 2-core AMD EPYC (Zen 5) CPU, 3 steps (losses: max relative difference per step; grads: max
# over parameters of the first gradients' relative norm difference):
#   float32: layout at most 1.6e-7 / 1.7e-7 (only the order of float32 sums differs: the MX casts see the
#            same values in every layout); MX effect 2.4e-5 / 7.9e-2 (every block weight's gradient moves
#            by 5.1e-2 at least).
#   bf16 (FSDP 2): layout 0 / 0 (each rank's share rounds as in the reference); MX effect against bf16
#            alone 5.0e-5 / 8.2e-2.
MX_FP32 = Tolerance(losses=5e-6, grads=1e-5)
MX_BF16 = Tolerance(losses=1e-5, grads=1e-3)
MX_EFFECT = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2_tp2"])
def test_mx_matches_single_process_mx_and_float32_does_not(layout):
    run = layout_runs(layout)["mx_fp32"]
    got, ref = layout_results(layout)["mx_fp32"], single_process_results(run.single_process())
    check_two_sided(got, ref, layout_results(layout)["fp32"], MX_FP32)
    # MX really ran in the reference (and so in the layout): every block weight's gradient moved.
    plain = single_process_results(run.precision_off().single_process())
    block_weights = [n for n in ref["first_grads"] if n.startswith("layers.") and "norm" not in n]
    assert min(_rel(ref["first_grads"][n], plain["first_grads"][n]) for n in block_weights) > MX_EFFECT


def test_mx_bf16_matches_single_process_under_fsdp_and_bf16_alone_does_not():
    run = layout_runs("fsdp2")["mx_bf16"]
    got, ref = layout_results("fsdp2")["mx_bf16"], single_process_results(run.single_process())
    check_two_sided(got, ref, layout_results("fsdp2")["bf16"], MX_BF16)


@pytest.mark.parametrize("ac_mode, ac_option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_mx_with_activation_checkpointing_reproduces_mx_without(ac_mode, ac_option):
    plain = Run(mx="mxfp8", steps=2)
    ref = single_process_results(plain)
    got = single_process_results(dataclasses.replace(plain, ac_mode=ac_mode, ac_option=ac_option))
    # The recomputed forward casts the same values with the same per-block scales: identical gradients.
    for name, grad in got["first_grads"].items():
        assert torch.equal(grad, ref["first_grads"][name]), name
    assert got["losses"] == ref["losses"]
