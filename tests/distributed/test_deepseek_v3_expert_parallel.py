"""DeepSeek-V3 under expert parallelism on gloo: EP 2 over 2 ranks (FSDP 2 for everything but the routed experts,
full activation checkpointing) trains a tiny model (one dense block, then MoE blocks with a shared expert and
group-limited routing) as one process does on the same global batches, through the family's parallelize function.

Loss semantics as the trainer's: each rank sums the token losses of its half of the global batch over the
whole batch's target tokens and adds half its balance loss; FSDP sums the gradients; the expert biases move
from the loads summed over the ranks. The reference runs the two halves in turn on one process, so in float32
only the order of sums differs (an expert's weight gradient sums both ranks' rows in one GEMM, FSDP
reduce-scatters the rest). Measured on a 2-core AMD EPYC (Zen 5) CPU: max relative loss difference 5.6e-7 over
5 AdamW steps, first gradients within 2.9e-7 of each tensor's largest entry, expert biases bitwise equal (their
update is a fixed step times the sign of the load imbalance). RTOL = 1e-5 leaves room for other CPUs'
summation orders; dropped remote tokens or unreduced gradients are far larger errors (Qwen3-MoE's negative
control in tests/distributed/test_expert_parallel.py moves the losses by 1.7e-4 relative within 3 steps)."""
from __future__ import annotations

import dataclasses

import torch
from _harness import run_ranks
from _llama_steps import GLOBAL_BATCH, LR, MAX_NORM, global_batches
from _moe_ep_steps import full_grads

from models.common.moe.hooks import moe_layers
from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.distributed.grad_clip import clip_grad_norm_

# Layer 0 dense, layers 1 and 2 MoE: 8 experts in 4 groups (top-2 groups), top-2, one shared expert.
ARGS = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], n_layers=3, max_seq_len=64)
STEPS = 5
RTOL = 1e-5


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepSeekV3Model(ARGS)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train(model, rank: int, shares_per_rank: int, shares: int, dp_group) -> dict:
    """STEPS AdamW steps; per-step global losses, the first step's full gradients, the final expert biases."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    rows = GLOBAL_BATCH // shares
    out: dict = {"losses": []}
    for step, (inputs, labels) in enumerate(global_batches(STEPS)):
        global_tokens = (labels != IGNORE_INDEX).sum().float()
        total = torch.zeros(())
        model.set_aux_loss_scale(1 / shares)
        for share in range(rank * shares_per_rank, (rank + 1) * shares_per_rank):
            loss_sum, _ = cross_entropy_sum(model(inputs[share * rows:(share + 1) * rows]),
                                            labels[share * rows:(share + 1) * rows])
            loss = loss_sum / global_tokens
            loss.backward()  # with the balance loss, weighted 1 / shares
            total += loss.detach()
        if step == 0:
            out["first_grads"] = full_grads(model)
        clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        model.post_optimizer_step(dp_group)
        if dp_group is not None:
            torch.distributed.all_reduce(total, group=dp_group)
        out["losses"].append(float(total))
    out["biases"] = [moe.expert_bias.clone() for moe in moe_layers(model)]
    return out


def ep_worker(rank: int, world_size: int) -> dict:
    from _deepseek_v3_build import build_parallel_deepseek_v3

    model, dims = build_parallel_deepseek_v3(ARGS, world_size, _initial_state(), ep=world_size)
    w1 = model.layers["1"].moe.experts.w1
    out = _train(model, rank, 1, world_size, dims.dp_mesh.get_group())
    out["local_experts"] = w1.to_local().shape[0]
    return out


def test_ep_2_trains_as_one_process():
    reference = DeepSeekV3Model(ARGS)
    reference.load_state_dict(_initial_state())
    expected = _train(reference, 0, 2, 2, None)
    results = run_ranks(ep_worker, 2, timeout_s=300)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got["biases"], results[0]["biases"], strict=True))
    for rank, got in enumerate(results):
        assert got["local_experts"] == 4, rank  # 8 experts split over 2 EP ranks
        for loss, ref in zip(got["losses"], expected["losses"], strict=True):
            assert abs(loss - ref) <= RTOL * abs(ref), (rank, got["losses"], expected["losses"])
        assert set(got["first_grads"]) == set(expected["first_grads"])
        for name, ref in expected["first_grads"].items():
            scale = ref.abs().max()
            assert (got["first_grads"][name] - ref).abs().max() <= RTOL * scale, (rank, name)
        # The biases moved (from the loads summed over both ranks) as the reference's did.
        for bias, ref in zip(got["biases"], expected["biases"], strict=True):
            assert bias.abs().max() > 0 and torch.allclose(bias, ref, rtol=0, atol=1e-7), rank
