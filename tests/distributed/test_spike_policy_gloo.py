"""training.spike_policy on FSDP 2 (gloo): a spike planted in one rank's data only is seen by both ranks
through the reduced loss, and both skip the same step with their parameter shards untouched."""
from __future__ import annotations

from _harness import run_ranks

SPIKE_STEP = 5


def _train_with_a_spike_on_rank1(rank: int, world_size: int, folder: str) -> dict:
    from _spike_runs import build_trainer, plant, record_steps, reference_labels, same

    trainer = build_trainer(folder, 7, "--parallelism.dp_shard", "2", "--training.spike_policy.enable", "true",
                            "--training.spike_policy.min_history", "3", "--training.spike_policy.max_rollbacks", "0")
    labels = reference_labels(trainer, SPIKE_STEP)
    if rank == 1:  # a corrupted batch on one rank
        plant(trainer, [labels[SPIKE_STEP - 1]])
    records = record_steps(trainer, snapshot=(SPIKE_STEP, SPIKE_STEP + 1))
    trainer.train()
    spike, after = records[SPIKE_STEP - 1], records[SPIKE_STEP]
    assert spike.params_before is not None and after.params_before is not None
    return {
        "actions": [(r.step, r.action) for r in records],
        "losses": [r.loss for r in records],
        "z": trainer.spike_guard.last_z if trainer.spike_guard else None,
        "shard_untouched": same(spike.params_before, spike.params_after),
        "adam_untouched": same(spike.adam_before, spike.adam_after),
        "next_step_trains": not same(after.params_before, after.params_after),
        "skipped": trainer.spike_guard.skipped_total if trainer.spike_guard else None,
    }


def test_a_spike_in_one_ranks_data_is_skipped_by_both_ranks(tmp_path):
    ranks = run_ranks(_train_with_a_spike_on_rank1, 2, str(tmp_path))
    expected = [(s, "skip" if s == SPIKE_STEP else "apply") for s in range(1, 8)]
    for result in ranks:
        assert result["actions"] == expected
        assert result["shard_untouched"] and result["adam_untouched"] and result["next_step_trains"]
        assert result["skipped"] == 1
    # Both ranks judged the same numbers, bit for bit.
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["z"] == ranks[1]["z"]
