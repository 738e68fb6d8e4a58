"""DeepSeek-V3 under FSDP 2 with full activation checkpointing on gloo, through the family's parallelize function:
each rank trains on half of the batch, and the averaged gradients equal one process's on the whole batch; the
expert weights are sharded on their expert dim."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from _harness import run_ranks

from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model

ARGS = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"], n_layers=2, max_seq_len=64)
CHECKED = ("layers.0.attention.wq_a.weight", "layers.1.attention.wkv_b.weight", "layers.1.moe.experts.w1",
           "layers.1.moe.router.gate.weight", "layers.1.moe.shared_experts.w2.weight", "output.weight")
# Only the order of float32 sums differs (the reduce-scatter adds two half-batch gradients, autograd the whole
# batch's rows at once): measured at most 5.7e-7 relative to each gradient's largest entry. A rank that kept its
# half-batch gradient (no reduction) is off by O(1) relative.
RTOL = 1e-5


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return DeepSeekV3Model(ARGS).state_dict()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, ARGS.vocab_size, (4, 32), generator=g), torch.randint(0, ARGS.vocab_size, (4, 32), generator=g)


def _grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, ranks: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of the whole batch's mean loss: the project's FSDP sums the ranks' gradients (the trainer
    normalises the loss by the global token count), so each rank's mean is divided by the rank count, and so is
    the MoE balance loss's weight (as the trainer sets it: its mean over the sequences of every rank)."""
    model.train()
    model.set_aux_loss_scale(1 / ranks)
    (F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten()) / ranks).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        # Activation checkpointing wraps each block: its parameters are named as the plain model's without the wrapper.
        grads[name.replace("._checkpoint_wrapped_module", "")] = (
            grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
    return {k: grads[k] for k in CHECKED}


def fsdp_worker(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], tuple[int, ...], str]:
    from _deepseek_v3_build import build_parallel_deepseek_v3

    model, dims = build_parallel_deepseek_v3(ARGS, world_size, _initial_state())
    tokens, labels = _batch()
    grads = _grads(model, tokens[rank::world_size], labels[rank::world_size], world_size)
    w1 = model.layers["1"].moe.experts.w1
    return grads, tuple(w1.to_local().shape), str(w1.placements)


def test_fsdp_with_full_ac_gives_the_single_process_gradients():
    reference = DeepSeekV3Model(ARGS)
    reference.load_state_dict(_initial_state())
    tokens, labels = _batch()
    expected = _grads(reference, tokens, labels)
    for grads, local_shape, placements in run_ranks(fsdp_worker, 2, timeout_s=300):
        assert local_shape == (4, 128, 256) and placements == "(Shard(dim=0),)"  # 8 experts over 2 ranks
        for name in CHECKED:
            scale = expected[name].abs().max()
            assert scale > 0 and (grads[name] - expected[name]).abs().max() <= RTOL * scale, name
