"""Dynamic loss scaler: overflow skips, growth, checkpoint state, DTensor grads, cross-rank agreement."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
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
    assert state == {"scale": 32.0, "growth_tracker": 2, "hysteresis_tracker": 0, "skipped_steps": 1}
    assert all(isinstance(v, (int, float)) for v in state.values())

    restored = GradScaler(init_scale=1.0, growth_interval=5)
    restored.load_state_dict({k: torch.tensor(v) for k, v in state.items()})  # as a checkpoint may return them
    assert restored.state_dict() == state
    for _ in range(3):  # the growth tracker survived: 3 more clean steps reach growth_interval=5
        _step(model, opt, restored, x)
    assert restored.scale_value == 64.0


def _scales(scaler, pattern: str, model=None, opt=None, x=None) -> list[float]:
    """Scale after each step of ``pattern`` ('O' = a step whose gradient overflows, 'C' = a clean one)."""
    if model is None:
        model, x = _model_and_data()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scales = []
    for kind in pattern:
        _step(model, opt, scaler, x, poison=kind == "O")
        scales.append(scaler.scale_value)
    return scales


def test_scale_never_backs_off_below_min_scale_and_says_so_at_the_floor(caplog):
    scaler = GradScaler(init_scale=8.0, min_scale=2.0, growth_interval=100)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        assert _scales(scaler, "OOOO") == [4.0, 2.0, 2.0, 2.0]
    assert scaler.skipped_steps == 4
    assert caplog.text.count("FP16 gradient overflow at the minimum loss scale 2 (precision.min_scale): step "
                             "skipped") == 2
    # A min_scale that is not a power of the backoff is still the floor, not skipped over.
    assert _scales(GradScaler(init_scale=8.0, min_scale=3.0), "OO") == [4.0, 3.0]


def test_hysteresis_follows_megatron_counting_overflows_since_the_last_growth(caplog):
    # Megatron-LM DynamicGradScaler.update: each overflow decrements the hysteresis tracker and backs off
    # only at 0; clean steps do not refill it, growth does. Hand-derived for hysteresis=2, interval 3:
    #   O: tracker 1, keep 16 | C | O: tracker 0 -> 8 | O: -> 4 | C C C: grow to 8, tracker 2 |
    #   O: tracker 1, keep 8 | O: tracker 0 -> 4
    scaler = GradScaler(init_scale=16.0, hysteresis=2, growth_interval=3)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        scales = _scales(scaler, "OCOOCCCOO")
    assert scales == [16.0, 16.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0, 4.0]
    assert scaler.skipped_steps == 5 and scaler.hysteresis_left == 0
    assert "loss scale stays 16 (hysteresis: 1 more overflow(s) before it backs off)" in caplog.text
    # hysteresis=1 is torch.amp's rule: every overflow backs off.
    assert _scales(GradScaler(init_scale=16.0, hysteresis=1, growth_interval=3), "OCOO") == [8.0, 8.0, 4.0, 2.0]


def test_static_scale_never_changes_but_overflow_steps_are_still_skipped():
    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=128.0, growth_interval=2, dynamic=False)
    assert _scales(scaler, "CCCC", model, opt, x) == [128.0] * 4  # no growth after growth_interval clean steps
    before = [p.detach().clone() for p in model.parameters()]
    assert _step(model, opt, scaler, x, poison=True) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.scale_value == 128.0 and scaler.skipped_steps == 1
    assert _step(model, opt, scaler, x)


def test_resume_continues_the_scale_sequence_exactly_hysteresis_included():
    pattern = "COCCOCCCOOCCC"
    uninterrupted = _scales(GradScaler(init_scale=64.0, hysteresis=3, growth_interval=3), pattern)
    first = GradScaler(init_scale=64.0, hysteresis=3, growth_interval=3)
    head = _scales(first, pattern[:5])
    assert first.hysteresis_left == 1  # two overflows since the start: the saved tracker matters
    resumed = GradScaler(init_scale=64.0, hysteresis=3, growth_interval=3)
    resumed.load_state_dict({k: torch.tensor(v) for k, v in first.state_dict().items()})
    assert head + _scales(resumed, pattern[5:]) == uninterrupted

    # A static scaler takes its scale from the config, the skip count from the checkpoint.
    static = GradScaler(init_scale=32.0, dynamic=False)
    static.load_state_dict(first.state_dict())
    assert static.scale_value == 32.0 and static.skipped_steps == first.skipped_steps


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
    with pytest.raises(ValueError, match="0 < min_scale <= init_scale and hysteresis >= 1"):
        GradScaler(init_scale=4.0, min_scale=8.0)


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


def test_scaler_state_survives_a_real_checkpoint_round_trip(tmp_path):
    from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper

    def manager(model, scaler):
        states = {"model": ModelWrapper(model), "grad_scaler": scaler}
        return CheckpointManager.Config(enable=True, interval=1).build(dump_folder=str(tmp_path), states=states)

    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    saved = GradScaler(init_scale=64.0, hysteresis=3, growth_interval=4)
    _scales(saved, "OCOC", model, opt, x)
    manager(model, saved).save(4, force=True)

    restored = GradScaler(init_scale=1.0, hysteresis=3, growth_interval=4)
    assert manager(copy.deepcopy(model), restored).load() == 4
    assert restored.state_dict() == saved.state_dict() == {
        "scale": 64.0, "growth_tracker": 1, "hysteresis_tracker": 1, "skipped_steps": 2}


def test_a_checkpoint_from_before_hysteresis_resumes_with_a_full_counter(tmp_path):
    # Earlier releases saved the scaler without a hysteresis counter; such a checkpoint must still resume
    # (scale and growth count exact), not stop on the key it lacks.
    from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper

    class EarlierScaler(GradScaler):
        def state_dict(self):
            state = super().state_dict()
            del state["hysteresis_tracker"]
            return state

    def manager(model, scaler):
        states = {"model": ModelWrapper(model), "grad_scaler": scaler}
        return CheckpointManager.Config(enable=True, interval=1).build(dump_folder=str(tmp_path), states=states)

    model, x = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    saved = EarlierScaler(init_scale=64.0, growth_interval=4)
    _scales(saved, "OCC", model, opt, x)
    manager(model, saved).save(3, force=True)

    restored = GradScaler(init_scale=1.0, hysteresis=2, growth_interval=4)
    assert manager(copy.deepcopy(model), restored).load() == 3
    assert restored.state_dict() == {"scale": 32.0, "growth_tracker": 2, "hysteresis_tracker": 2, "skipped_steps": 1}
