"""A checkpoint saved on FSDP 2 (async, with float8 all-gather weights in a second model) loads on
1 process and on FSDP x TP 2x2, and training continues with the same losses."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from _ckpt_spawn import run_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper

DIM = 64
# Sharded and unsharded runs sum the same products in different orders (reduce-scatter vs local
# matmul, TP partial sums); fp32 rounding differences stay orders of magnitude below 1e-5.
TOL = 1e-5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Optim:
    def __init__(self, model: nn.Module) -> None:
        self.model, self.opt = model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, state) -> None:
        set_optimizer_state_dict(self.model, self.opt, state)


class Position:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state) -> None:
        self.value = int(state["value"])


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    out = model(batch(step))
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    return out.pow(2).mean()


def build(model: nn.Module, dump: str, rank: int, **cfg):
    optim = Optim(model)
    states = {"model": ModelWrapper(model), "optimizer": optim, "dataloader": Position(100 + rank),
              "train_state": Position(0)}
    ckpt = CheckpointManager.Config(enable=True, interval=2, **cfg).build(dump_folder=dump, states=states)
    return optim, states, ckpt


def step_then_loss(model, optim, step: int) -> float:
    loss_of(model, step).backward()
    optim.opt.step()
    optim.opt.zero_grad()
    return loss_of(model, step + 1).item()


def fsdp2_save(rank: int, world_size: int, dump: str) -> tuple[float, float]:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = fully_shard(Tiny())
    optim, states, ckpt = build(model, os.path.join(dump, "run"), rank, async_mode="async")
    for step in (1, 2):
        loss_of(model, step).backward()
        optim.opt.step()
        optim.opt.zero_grad()
        states["train_state"].value = step
        ckpt.save(step)
    ckpt.close()
    first_loss = loss_of(model, 3).item()

    torch.manual_seed(0)
    fp8 = convert_to_float8_training(Tiny(), config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    fp8 = fully_shard(fp8)
    assert "Float8" in type(fp8.w1.weight.to_local()).__name__  # the DTensor-over-float8-wrapper case
    fp8_ckpt = CheckpointManager.Config(enable=True).build(dump_folder=os.path.join(dump, "fp8"),
                                                           states={"model": ModelWrapper(fp8)})
    fp8_ckpt.save(1, force=True)
    return first_loss, step_then_loss(model, optim, 3)


def fsdp_tp_load(rank: int, world_size: int, dump: str) -> tuple[int, int, float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    model = parallelize_module(Tiny(), mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    model = fully_shard(model, mesh=mesh["dp"])
    optim, states, ckpt = build(model, os.path.join(dump, "run"), rank)
    step = ckpt.load()
    return step, states["train_state"].value, loss_of(model, 3).item(), step_then_loss(model, optim, 3)


def test_fsdp2_checkpoint_reshards_to_one_process_and_fsdp_tp(tmp_path):
    dump = str(tmp_path)
    (ref_first, ref_next), other = run_ranks(fsdp2_save, 2, dump)
    assert other == (ref_first, ref_next)  # FSDP ranks agree on the full loss

    # One process, plain model: per-rank data positions do not reshard (fresh), the step does.
    torch.manual_seed(2)
    model = Tiny()
    optim, states, ckpt = build(model, os.path.join(dump, "run"), rank=0)
    assert ckpt.load() == 2 and states["train_state"].value == 2 and states["dataloader"].value == 100
    assert loss_of(model, 3).item() == pytest.approx(ref_first, abs=TOL)
    assert step_then_loss(model, optim, 3) == pytest.approx(ref_next, abs=TOL)  # Adam moments resharded

    for step, train_step, first, nxt in run_ranks(fsdp_tp_load, 4, dump):
        assert (step, train_step) == (2, 2)
        assert first == pytest.approx(ref_first, abs=TOL) and nxt == pytest.approx(ref_next, abs=TOL)

    # The float8 model's checkpoint holds plain tensors: weights_only loading works and equals the init.
    out = tmp_path / "fp8.pt"
    dcp_to_torch_save(os.path.join(dump, "fp8", "checkpoint", "step-1"), out)
    saved = torch.load(out, weights_only=True)["model"]
    torch.manual_seed(0)
    expected = Tiny().state_dict()
    assert {type(v) for v in saved.values()} == {torch.Tensor}
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
