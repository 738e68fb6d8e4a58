import contextlib
import multiprocessing
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.validate import Validator

VOCAB = 16


class Recorder(nn.Module):
    """Tiny LM that records the mode and grad state of each forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled()))
        return self.out(self.emb(tokens))


def _batches(n: int, seed: int = 0, batch: int = 2, seq: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        inputs = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        labels[0, : i + 1] = IGNORE_INDEX  # batches carry different numbers of target tokens
        out.append((inputs, labels))
    return out


def _reference(model: nn.Module, batches) -> float:
    """Token-weighted mean: one cross-entropy over all target tokens of all batches."""
    with torch.no_grad():
        logits = torch.cat([model(x).flatten(0, 1) for x, _ in batches])
        labels = torch.cat([y.flatten() for _, y in batches])
        return float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX))


def _validator(**kwargs) -> Validator:
    config = Validator.Config(enable=True, steps=kwargs.pop("steps", -1))
    return config.build(loss_fn=cross_entropy_sum, device="cpu", **kwargs)


def test_loss_is_token_weighted_over_all_batches():
    model, data = Recorder(), _batches(4)
    loss = _validator(dataloader=data).validate([model], step=10)
    # Same float32 math summed in a different order (float64 accumulation here): ~1e-6 relative.
    assert loss == pytest.approx(_reference(model, data), rel=1e-6)
    # Not the unweighted mean of per-batch means, which differs because token counts differ.
    per_batch = [_reference(model, [b]) for b in data]
    assert loss != pytest.approx(sum(per_batch) / len(per_batch), rel=1e-6)


def test_a_mixture_gets_each_sources_loss_and_their_mean_by_mixture_weight():
    model = Recorder()
    code, prose = _batches(3, seed=1), _batches(1, seed=2)  # unequal token counts: weights, not tokens, decide
    validator = _validator(source_factories={"code": lambda: code, "prose": lambda: prose},
                           source_weights={"code": 3.0, "prose": 1.0})
    loss = validator.validate([model], step=5)
    by_source = validator.last_by_source
    assert by_source == pytest.approx({"code": _reference(model, code), "prose": _reference(model, prose)}, rel=1e-6)
    assert by_source["code"] != pytest.approx(by_source["prose"], rel=1e-3)
    assert loss == pytest.approx((3 * by_source["code"] + by_source["prose"]) / 4, rel=1e-9)
    assert _validator(dataloader=code).validate([model], step=5) and not _validator(dataloader=code).last_by_source


def test_steps_limits_batches_and_every_call_restarts_the_data():
    model, data = Recorder(), _batches(5)
    calls = []

    def factory():
        calls.append(1)
        return iter(data)  # a one-shot iterator: only a fresh one per call restarts

    validator = _validator(dataloader_factory=factory, steps=2)
    first = validator.validate([model], step=1)
    second = validator.validate([model], step=2)
    assert len(calls) == 2 and first == second
    assert len(model.seen) == 4
    assert first == pytest.approx(_reference(model, data[:2]), rel=1e-6)


def test_runs_in_eval_without_grad_and_restores_modes():
    model = Recorder()
    model.train()
    _validator(dataloader=_batches(2)).validate([model], step=1)
    assert model.seen == [(False, False), (False, False)]
    assert model.training and all(p.grad is None for p in model.parameters())

    model.eval()
    _validator(dataloader=_batches(1)).validate([model], step=1)
    assert not model.training


def test_train_mode_is_restored_when_the_forward_fails():
    model = Recorder().train()

    def broken_loss(logits, labels):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Validator.Config().build(loss_fn=broken_loss, device="cpu", dataloader=_batches(1)).validate([model], 1)
    assert model.training


def test_autocast_and_loss_context_wrap_each_forward():
    entered = {"autocast": 0, "loss": 0}
    dtypes = []

    @contextlib.contextmanager
    def counting(name, inner):
        entered[name] += 1
        with inner:
            yield

    def loss_fn(logits, labels):
        dtypes.append(logits.dtype)
        return cross_entropy_sum(logits, labels)

    model, data = Recorder(), _batches(3)
    validator = Validator.Config(steps=-1).build(
        loss_fn=loss_fn, device="cpu", dataloader=data,
        autocast=lambda: counting("autocast", torch.autocast("cpu", dtype=torch.bfloat16)),
        loss_context=lambda: counting("loss", contextlib.nullcontext()),
    )
    loss = validator.validate([model], step=1)
    assert entered == {"autocast": 3, "loss": 3}
    assert dtypes == [torch.bfloat16] * 3
    # bf16 logits carry ~3 significant digits: the loss moves by well under 2%.
    assert loss == pytest.approx(_reference(model, data), rel=2e-2)


def test_no_tokens_is_an_error():
    labels = torch.full((2, 6), IGNORE_INDEX)
    data = [(torch.zeros(2, 6, dtype=torch.long), labels)]
    with pytest.raises(RuntimeError, match=r"validation at step 7 saw no target tokens \(1 batches\)"):
        _validator(dataloader=data).validate([Recorder()], step=7)


def test_interface_errors():
    with pytest.raises(ValueError, match="exactly one of dataloader_factory=, dataloader= or source_factories="):
        Validator.Config().build(loss_fn=cross_entropy_sum, device="cpu")
    with pytest.raises(ValueError, match="exactly one of"):
        Validator.Config().build(loss_fn=cross_entropy_sum, device="cpu", dataloader=[], dataloader_factory=list)
    with pytest.raises(ValueError, match="got 2 model parts"):
        _validator(dataloader=_batches(1)).validate([Recorder(), Recorder()], step=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"freq": 0}, r"validation.freq must be >= 1, got 0"),
     ({"steps": 0}, r"validation.steps must be a positive number of batches or -1"),
     ({"steps": -2}, r"validation.steps must be .* got -2")],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Validator.Config(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Two data-parallel ranks on gloo: sums are combined and ranks with more batches stop with the others.

def _dp_worker(rank: int, world_size: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        data = _batches(3 if rank == 0 else 2, seed=rank)  # rank 0 has one batch more
        model = Recorder()
        loss = _validator(dataloader=data, dp_group=dist.group.WORLD).validate([model], step=1)
        queue.put((rank, loss, len(model.seen)))
        dist.barrier()  # leave together (a rank tearing gloo down under its peer aborts the peer)
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_sum_tokens_and_stop_together():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dp_worker, args=(rank, 2, port, queue)) for rank in range(2)]
    env = os.environ.copy()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children
    try:
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=120) for _ in procs)
    finally:
        os.environ.clear()
        os.environ.update(env)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = _reference(Recorder(), _batches(2, seed=0) + _batches(2, seed=1))
    for rank, loss, forwards in results:
        assert forwards == 2, f"rank {rank} ran {forwards} forwards"
        # Same float32 math summed in another order: ~1e-6 relative.
        assert loss == pytest.approx(expected, rel=1e-6)
