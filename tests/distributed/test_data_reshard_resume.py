"""A run checkpointed on FSDP 2 (2 data-parallel ranks) resumes on TP 2 (1 data-parallel rank) with no flag:
it trains on, keeps the global batch it was given with 2 micro-batches per step instead of 1, and reads
exactly what one uninterrupted rank reads after the windows the FSDP ranks trained on (the position counts
windows of one global order). Then one process (another world size, the same data-parallel degree)
continues where TP 2 stopped."""
from __future__ import annotations

import json
import os

import torch
from _harness import run_ranks

FIRST, LAST, SINGLE = 3, 5, 6
GLOBAL = ["--training.global_batch_size", "4"]  # local 2 x dp 2 x 1, then local 2 x dp 1 x 2


def _train(rank: int, world_size: int, folder: str, steps: int, *layout: str) -> dict:
    from _spike_runs import build_trainer

    trainer = build_trainer(folder, steps, "--checkpoint.enable", "true", "--checkpoint.interval", str(FIRST),
                            *GLOBAL, *layout)
    consumed: list[torch.Tensor] = []
    step = trainer.train_step

    def recording(batches):
        consumed.extend(labels.clone() for _, labels in batches)
        return step(batches)

    trainer.train_step = recording
    trainer.train()
    return {"labels": consumed, "n_microbatches": trainer.n_microbatches, "dp": trainer.parallel_dims.dp_degree,
            "step": trainer.train_state.step, "tokenizer": trainer.tokenizer, "config": trainer.config}


def _in_order(result: dict, skip: int, take: int) -> list[torch.Tensor]:
    """Labels of local batches ``skip`` to ``skip + take`` of one rank reading the run's global order alone."""
    cfg = result["config"]
    loader = cfg.data.build(tokenizer=result["tokenizer"], dp_rank=0, dp_world_size=1, seq_len=cfg.training.seq_len,
                            local_batch_size=cfg.training.local_batch_size, split="train", infinite=True,
                            seed=cfg.training.seed)
    it = iter(loader)
    return [next(it)[1] for _ in range(skip + take)][skip:]


def test_fsdp2_checkpoint_resumes_on_tp2_reading_on_in_the_window_order(tmp_path):
    folder = str(tmp_path)
    before = run_ranks(_train, 2, folder, FIRST, "--parallelism.dp_shard", "2")
    assert [r["dp"] for r in before] == [2, 2] and [r["n_microbatches"] for r in before] == [1, 1]
    after = run_ranks(_train, 2, folder, LAST, "--parallelism.tp", "2")
    assert [r["step"] for r in after] == [LAST, LAST]
    assert [r["dp"] for r in after] == [1, 1] and [r["n_microbatches"] for r in after] == [2, 2]
    # The FSDP ranks read global micro-batches of 2 x 2 windows, rank r the rows r, r + 2: one rank of batch 2
    # reading alone reads them as two local batches per step.
    first = _in_order(after[0], 0, FIRST * 2)
    for r, result in enumerate(before):
        assert all(torch.equal(a, torch.stack([b[r], c[r]])) for a, b, c in
                   zip(result["labels"], first[0::2], first[1::2], strict=True))
    # Both TP ranks read the same batches: the ones after those, none the FSDP ranks trained on.
    expected = _in_order(after[0], FIRST * 2, (SINGLE - FIRST) * 2)
    tp_part = expected[:(LAST - FIRST) * 2]
    for result in after:
        assert len(result["labels"]) == len(tp_part)
        assert all(torch.equal(a, b) for a, b in zip(result["labels"], tp_part, strict=True))
    trained_before = [b for r in before for batch in r["labels"] for b in batch]
    assert not any(torch.equal(a, b) for batch in expected for a in batch for b in trained_before)
    with open(os.path.join(folder, "checkpoint", f"step-{LAST}", ".complete")) as f:
        layout = json.load(f)["data_layout"]
    assert (layout["dp_degree"], layout["n_microbatches"], layout["local_batch_size"]) == (1, 2, 2)

    # Two TP ranks saved the same position; one process reads on from it.
    (single,) = run_ranks(_train, 1, folder, SINGLE)
    assert single["step"] == SINGLE and single["n_microbatches"] == 2
    assert all(torch.equal(a, b) for a, b in zip(single["labels"], expected[len(tp_part):], strict=True))


def _data_seed(rank: int, world_size: int, folder: str) -> int | None:
    from _spike_runs import build_trainer

    return build_trainer(folder, 1, "--parallelism.dp_shard", "2", "--training.seed", "none").dataloader.seed


def test_without_training_seed_the_ranks_share_a_drawn_data_order(tmp_path):
    seeds = run_ranks(_data_seed, 2, str(tmp_path))
    assert seeds[0] is not None and seeds[0] == seeds[1]
