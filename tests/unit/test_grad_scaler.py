"""Dynamic loss scaler: overflow skips, growth, checkpoint state, DTensor grads, cross-rank agreement."""
from __future__ import annotations

import copy
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from torchtitan_lite.components.grad_scaler import GradScaler


def _model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Linear(8, 8), torch.randn(4, 8)


def _step(model, opt, scaler, x, *, poison: bool = False) -> bool:
    loss = model(x).pow(2).mean()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    stepped = scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return stepped


def test_unscale_restores_the_unscaled_gradients_exactly():
    model, x = _model_and_data()
    reference = copy.deepcopy(model)
    reference(x).pow(2).mean().backward()
    scaler = GradScaler(init_scale=2.0**12)
    scaler.scale(model(x).pow(2).mean()).backward()
    assert not scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    # A power-of-two scale multiplies and divides exactly in float32: bitwise equality is expected.
    assert torch.equal(model.weight.grad, reference.weight.grad)
    assert torch.equal(model.bias.grad, reference.bias.grad)


def test_overflow_skips_the_step_and_halves_the_scale(caplog):
    model, x = _model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=1024.0, growth_interval=100)
    assert _step(model, opt, scaler, x)  # a clean step creates Adam's state
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())

    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        stepped = _step(model, opt, scaler, x, poison=True)

    assert stepped is False
    assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
    state_after = opt.state_dict()["state"]
    for index, entry in state_before["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state_after[index][key]), f"optimizer state {key} changed"
    assert scaler.skipped_steps == 1
    assert scaler.scale_value == 512.0
    assert "FP16 gradient overflow: step skipped (1 so far), loss scale 1024 -> 512" in caplog.text
    assert _step(model, opt, scaler, x)  # training continues after the skip
    assert not all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))


def test_nan_gradient_is_an_overflow_too():
    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=8.0)
    scaler.scale(model(x).sum()).backward()
    model.bias.grad[3] = float("nan")
    assert scaler.step(opt) is False  # step() unscales by itself when unscale_ was not called
    scaler.update()
    assert scaler.scale_value == 4.0 and scaler.skipped_steps == 1


def test_scale_grows_after_growth_interval_clean_steps_and_tracker_resets_on_overflow():
    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    scales = []
    for poison in [False, False, False, False, False, True, False, False, False]:
        _step(model, opt, scaler, x, poison=poison)
        scales.append(scaler.scale_value)
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_state_dict_round_trip_with_numbers_and_tensors():
    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=64.0, growth_interval=5)
    for poison in [False, True, False, False]:
        _step(model, opt, scaler, x, poison=poison)
    state = scaler.state_dict()
    assert state == {"scale": 32.0, "growth_tracker": 2, "skipped_steps": 1}
    assert all(isinstance(v, (int, float)) for v in state.values())

    restored = GradScaler(init_scale=1.0, growth_interval=5)
    restored.load_state_dict({k: torch.tensor(v) for k, v in state.items()})  # as a checkpoint may return them
    assert restored.state_dict() == state
    for _ in range(3):  # the growth tracker survived: 3 more clean steps reach growth_interval=5
        _step(model, opt, restored, x)
    assert restored.scale_value == 64.0


def test_misuse_is_reported():
    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match=r"update\(\) called without unscale_\(\)/step\(\)"):
        scaler.update()
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was already called for this step"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="need init_scale > 0, growth_factor > 1"):
        GradScaler(backoff_factor=1.5)


def test_dtensor_gradients_of_an_fsdp_model_are_unscaled_and_checked():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("needs its own single-rank process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, x = _model_and_data()
        reference = copy.deepcopy(model)
        reference(x).pow(2).mean().backward()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler(init_scale=2.0**10)

        scaler.scale(model(x).pow(2).mean()).backward()
        assert isinstance(model.weight.grad, DTensor)
        assert not scaler.unscale_(opt)
        # Power-of-two scale: exact, as in the plain-tensor case.
        assert torch.equal(model.weight.grad.full_tensor(), reference.weight.grad)
        assert scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        before = model.weight.full_tensor().clone()
        scaler.scale(model(x).pow(2).mean()).backward()
        model.weight.grad.to_local()[1, 2] = float("inf")
        assert scaler.step(opt) is False
        scaler.update()
        assert torch.equal(model.weight.full_tensor(), before)
        assert scaler.skipped_steps == 1 and scaler.scale_value == 512.0
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, world_size: int, folder: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        model, x = _model_and_data(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = GradScaler(init_scale=256.0)
        before = model.weight.detach().clone()
        # Only rank 1 overflows: rank 0 must still skip, or the replicas would diverge.
        stepped = _step(model, opt, scaler, x, poison=rank == 1)
        result = {"stepped": stepped, "scale": scaler.scale_value, "skipped": scaler.skipped_steps,
                  "unchanged": torch.equal(before, model.weight)}
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        # Both ranks leave together: a rank tearing gloo down while its peer still holds the pair
        # aborts the peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_overflow_on_one_rank_makes_every_rank_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result == {"stepped": False, "scale": 128.0, "skipped": 1, "unchanged": True}
