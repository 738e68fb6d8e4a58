"""What a resume changes in how data is fed, judged from the checkpoint's marker before launch."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.components.checkpoint.layout import new_marker, step_dir
from torchtitan_lite.components.data.layout import DataLayout, resume_changes
from torchtitan_lite.config import parse_cli
from torchtitan_lite.launch_check import check_resume
from torchtitan_lite.resolved_run import resolve_run

FSDP2 = DataLayout(dp_degree=2, local_batch_size=8, n_microbatches=1, seq_len=64, dataset="embedded", streaming=False,
                   position="windows")
TP2 = DataLayout(dp_degree=1, local_batch_size=8, n_microbatches=1, seq_len=64, dataset="embedded", streaming=False,
                 position="windows")
TP2_KEPT = DataLayout(dp_degree=1, local_batch_size=8, n_microbatches=2, seq_len=64, dataset="embedded",
                      streaming=False, position="windows")


def test_a_new_degree_continues_the_position_and_an_unset_global_batch_warns_with_both_numbers():
    notes, warnings = resume_changes(FSDP2, TP2, step=20, data_loaded=True, global_batch_set=False)
    assert notes == ["the data position of step 20 continues from 2 on 1 data-parallel rank(s): it counts the windows "
                     "of the global order read so far, so every window is read once, none twice (README, 'Resuming "
                     "with another layout')"]
    assert warnings == ["the global batch changes on resume from step 20: saved 16 = local 8 x data-parallel 2 x 1 "
                        "micro-batch(es), now 8 = local 8 x data-parallel 1 x 1 micro-batch(es); set "
                        "--training.global_batch_size 16 to keep it (the micro-batches per step adjust to the "
                        "data-parallel degree)"]


def test_a_set_global_batch_is_kept_with_more_micro_batches():
    notes, warnings = resume_changes(FSDP2, TP2_KEPT, step=20, data_loaded=True, global_batch_set=True)
    assert warnings == []
    assert notes[1] == ("global batch 16 kept from step 20: was 16 = local 8 x data-parallel 2 x 1 micro-batch(es), "
                        "now 16 = local 8 x data-parallel 1 x 2 micro-batch(es)")


def test_the_same_layout_changes_nothing_and_an_excluded_position_is_not_resharded():
    assert resume_changes(FSDP2, FSDP2, step=3, data_loaded=True, global_batch_set=False) == ([], [])
    notes, warnings = resume_changes(FSDP2, TP2_KEPT, step=3, data_loaded=False, global_batch_set=True)
    assert not any("position" in n for n in notes) and warnings == []


@pytest.mark.parametrize("change,message", [
    (dict(streaming=True, position="stream"),
     r"saved by 2 data-parallel rank\(s\) reading a streaming dataset .* this run has 1"),
    (dict(seq_len=128), r"saved with training.seq_len=64, this run has 128"),
    (dict(dataset="data/*.jsonl"), r"saved with data.dataset='embedded', this run has 'data/\*.jsonl'"),
])
def test_positions_that_cannot_continue_are_refused(change, message):
    saved = DataLayout(**(FSDP2.to_record() | ({"streaming": True, "position": "stream"} if "streaming" in change
                                               else {})))
    now = DataLayout(**(TP2.to_record() | change))
    with pytest.raises(ValueError, match=message + ".*--checkpoint.exclude_from_loading dataloader"):
        resume_changes(saved, now, step=20, data_loaded=True, global_batch_set=False)


def test_a_position_from_before_layouts_were_recorded_is_refused_unless_excluded():
    with pytest.raises(ValueError, match=r"step 7 was written by an earlier version of the data loader.*"
                                         r"--checkpoint.exclude_from_loading dataloader"):
        resume_changes(None, TP2, step=7, data_loaded=True, global_batch_set=False)
    assert resume_changes(None, TP2, step=7, data_loaded=False, global_batch_set=False) == ([], [])


def test_a_per_rank_document_position_is_refused_unless_excluded():
    # A marker of the loader that read documents per rank records no position kind.
    record = FSDP2.to_record()
    del record["position"]
    saved = DataLayout.from_record(record)
    with pytest.raises(ValueError, match=r"step 7 counts documents read per rank.*reads windows of a token store.*"
                                         r"--checkpoint.exclude_from_loading dataloader"):
        resume_changes(saved, TP2, step=7, data_loaded=True, global_batch_set=False)
    assert resume_changes(saved, TP2, step=7, data_loaded=False, global_batch_set=False)[1] != []


def _config(folder, *extra):
    argv = ["--config", "llama3_debug", "--checkpoint.enable", "true", "--training.local_batch_size", "8",
            "--training.seq_len", "64", "--job.dump_folder", str(folder), *extra]
    return parse_cli(argv, registry=DEFAULT_REGISTRY).config


def _save_marker(folder, step, layout, states=("dataloader", "model")):
    path = step_dir(os.path.join(folder, "checkpoint"), step)
    os.makedirs(path)
    new_marker(step, 2, list(states), False, None if layout is None else layout.to_record()).write(path)


def test_check_resume_reads_the_newest_complete_checkpoint(tmp_path):
    _save_marker(tmp_path, 10, TP2)
    _save_marker(tmp_path, 20, FSDP2)
    os.makedirs(step_dir(str(tmp_path / "checkpoint"), 30))  # incomplete: no marker, never resumed from
    config = _config(tmp_path, "--parallelism.tp", "2")
    notes, warnings = check_resume(config, resolve_run(config, world_size=2, device_type="cpu"))
    assert "continues from 2 on 1" in notes[0] and "saved 16 = local 8 x data-parallel 2" in warnings[0]
    config = _config(tmp_path, "--parallelism.tp", "2", "--checkpoint.load_step", "10")
    assert check_resume(config, resolve_run(config, world_size=2, device_type="cpu")) == ([], [])


def test_check_resume_without_checkpoints_or_with_a_model_only_one_says_nothing(tmp_path):
    config = _config(tmp_path, "--parallelism.tp", "2")
    run = resolve_run(config, world_size=2, device_type="cpu")
    assert check_resume(config, run) == ([], [])
    _save_marker(tmp_path, 5, None, states=("model",))
    assert check_resume(config, run) == ([], [])


@pytest.mark.parametrize("saved_global, dp, local, advice", [
    # The probe's case: 16 = local 8 x dp 1 x 2, resumed on dp 4 with local 8 (32 per pass): the batch 16 alone
    # would be refused ("must be a multiple of 32"); local 4 keeps it.
    (16, 4, 8, "--training.global_batch_size 16 --training.local_batch_size 4 to keep it"),
    (24, 4, 8, "--training.global_batch_size 24 --training.local_batch_size 6 to keep it"),
    (32, 2, 8, "--training.global_batch_size 32 to keep it"),
    (18, 4, 2, "--training.global_batch_size 16 (the nearest multiple of local 2 x data-parallel 4)"),
    (6, 4, 8, "--training.global_batch_size 32 (the nearest multiple of local 8 x data-parallel 4)"),
])
def test_the_advice_to_keep_the_global_batch_names_options_the_run_accepts(saved_global, dp, local, advice):
    from torchtitan_lite.config.sections import TrainingConfig
    from torchtitan_lite.resolved_run import microbatches_per_step

    saved = DataLayout(dp_degree=1, local_batch_size=saved_global, n_microbatches=1, seq_len=64,
                       dataset="embedded", streaming=False)
    now = DataLayout(dp_degree=dp, local_batch_size=local, n_microbatches=1, seq_len=64, dataset="embedded",
                     streaming=False)
    _, warnings = resume_changes(saved, now, step=10, data_loaded=True, global_batch_set=False)
    assert len(warnings) == 1 and advice in warnings[0], warnings
    # Apply the advice as the command line would and hold it against the run's own rule.
    words = warnings[0].split("set ")[-1].split()
    flags = {words[i]: int(words[i + 1].rstrip(",")) for i in range(len(words) - 1) if words[i].startswith("--")}
    training = TrainingConfig(local_batch_size=flags.get("--training.local_batch_size", local),
                              global_batch_size=flags["--training.global_batch_size"])
    assert microbatches_per_step(training, dp) >= 1


def test_a_resume_needs_steps_left_to_train():
    from torchtitan_lite.train_state import check_steps_ahead

    check_steps_ahead(10, 10, "out/checkpoint")  # a finished run launched again: nothing left, nothing lost
    check_steps_ahead(10, 20, "out/checkpoint")
    with pytest.raises(ValueError, match=r"^the checkpoint in out/checkpoint is at step 10, beyond training.steps=8: "
                                         r"resuming it would train nothing\. Set --training.steps above 10"):
        check_steps_ahead(10, 8, "out/checkpoint")


@pytest.mark.parametrize("reported", [None, "1"])
def test_workers_say_the_resume_changes_only_where_run_train_sh_has_not(monkeypatch, caplog, reported):
    # The default suite's cover of test_check_resume.py's launch through run_train.sh (slow): its check before
    # torchrun prints these lines, then exports RESUME_REPORTED_ENV so that the workers stay silent.
    from types import SimpleNamespace

    from torchtitan_lite.components.data.layout import RESUME_REPORTED_ENV
    from torchtitan_lite.trainer_setup import report_resumed_layout

    if reported is None:
        monkeypatch.delenv(RESUME_REPORTED_ENV, raising=False)
    else:
        monkeypatch.setenv(RESUME_REPORTED_ENV, reported)
    run = SimpleNamespace(data_layout=lambda data: TP2)
    with caplog.at_level("INFO"):
        report_resumed_layout(FSDP2, run, None, step=20, data_loaded=True, global_batch_set=False)
    said = [r.getMessage() for r in caplog.records]
    changes = [m for m in said if "continues from 2 on 1" in m or "global batch changes on resume" in m]
    assert len(changes) == (2 if reported is None else 0), said


def test_run_train_sh_marks_the_resume_reported_after_its_check_and_before_torchrun():
    from torchtitan_lite.components.data.layout import RESUME_REPORTED_ENV

    script = (Path(__file__).resolve().parents[2] / "run_train.sh").read_text()
    check, export, launch = (script.index("--check-config"), script.index(f"export {RESUME_REPORTED_ENV}=1"),
                             script.index("torchrun_graceful.sh"))
    assert check < export < launch
