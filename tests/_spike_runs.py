"""In-process training runs with planted loss spikes, for the spike-policy tests.

A spike is planted by content, as a corrupted batch would cause it: the loss of any micro-batch whose
labels equal one of the poisoned batches is multiplied by a large factor. After a rollback the same
batches would spike again if they were read again, so a test also sees whether the data was skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import parse_cli
from torchtitan_lite.trainer import Trainer

TINY = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.log_freq", "1", "--metrics.cpu_peak_tflops", "1"]
"""llama3_debug at tens of milliseconds a step on a CPU, logging every step, no validation."""


def build_trainer(folder, steps: int, *extra: str) -> Trainer:
    argv = ["--config", "llama3_debug", *TINY, "--training.steps", str(steps), "--checkpoint.enable", "false",
            "--job.dump_folder", str(folder), *extra]
    return parse_cli(argv, registry=DEFAULT_REGISTRY).config.build()


def reference_labels(trainer: Trainer, n: int) -> list[torch.Tensor]:
    """The labels of the first ``n`` batches this trainer's data loader hands out, from a fresh loader."""
    cfg = trainer.config
    loader = cfg.data.build(tokenizer=trainer.tokenizer, dp_rank=trainer.parallel_dims.dp_rank,
                            dp_world_size=trainer.parallel_dims.dp_degree, seq_len=cfg.training.seq_len,
                            local_batch_size=cfg.training.local_batch_size, split="train", infinite=True,
                            seed=cfg.training.seed)
    it = iter(loader)
    return [next(it)[1].clone() for _ in range(n)]


def plant(trainer: Trainer, poisoned: list[torch.Tensor], factor: float = 1e4) -> None:
    original = trainer.runner.loss_fn

    def loss_fn(logits, labels):
        loss_sum, count = original(logits, labels)
        if any(p.shape == labels.shape and torch.equal(p, labels.cpu()) for p in poisoned):
            loss_sum = loss_sum * factor
        return loss_sum, count

    trainer.runner.loss_fn = loss_fn


@dataclass
class StepRecord:
    step: int
    labels: torch.Tensor
    loss: float
    action: str | None
    lr: float
    z_score: float | None = None
    """The policy's largest z-score for the step (None with the policy off or not armed yet)."""
    params_before: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    params_after: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    adam_before: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    adam_after: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def record_steps(trainer: Trainer, snapshot: tuple[int, ...] = ()) -> list[StepRecord]:
    """Wrap ``train_step`` to record, per call: the step, its labels, loss, lr and the policy's verdict;
    for the calls numbered in ``snapshot`` (1-based) also copies of the local parameters and AdamW state
    before and after."""
    records: list[StepRecord] = []
    original = trainer.train_step

    def train_step(batches):
        copy = len(records) + 1 in snapshot
        before, adam_before = (params_of(trainer), adam_of(trainer)) if copy else (None, None)
        lr = trainer.lr_schedulers.last_lr
        loss, grad_norm = original(batches)
        verdict = trainer.last_verdict
        record = StepRecord(trainer.train_state.step, batches[0][1].clone(), float(loss),
                            None if verdict is None else verdict.action, lr, None if verdict is None else verdict.z_score,
                            before, adam_before=adam_before)
        if copy:
            record.params_after, record.adam_after = params_of(trainer), adam_of(trainer)
        records.append(record)
        return loss, grad_norm

    trainer.train_step = train_step
    return records


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    return {n: local(p) for n, p in trainer.model_parts[0].named_parameters()}


def adam_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {}
    for i, opt in enumerate(trainer.optimizers):
        # Every group: weight-decayed matrices and the undecayed norms / biases sit in separate groups.
        params = [p for group in opt.param_groups for p in group["params"]]
        # Before the first step no parameter has state; after it every one must (a missed one is not compared).
        assert not opt.state or all(p in opt.state for p in params), "a parameter without AdamW state"
        for j, p in enumerate(params):
            for key, value in opt.state.get(p, {}).items():
                v = value.to_local() if hasattr(value, "to_local") else value
                state[f"{i}.{j}.{key}"] = v.detach().clone()
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
