"""scripts/loss_compare.py (torchtitan_lite/tools/loss_compare.py): gap arithmetic, exit codes and outputs on fake runs,
plus one real comparison."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchtitan_lite.tools import loss_compare as lc

REPO = Path(__file__).resolve().parents[2]


def _fake_run(folder: Path, losses: dict[int, float]) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder / "tb"))
    for step, loss in losses.items():
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/lr", 1e-3, step)
    writer.close()
    return folder


@pytest.fixture
def runs(tmp_path):
    # base: 3.0 - 0.01*step. "near" is 0.01 above on every step. "far" is 0.5 above for steps 1..10,
    # then 0.02 below: its mean |gap| depends on the averaging window.
    base = {s: 3.0 - 0.01 * s for s in range(1, 31)}
    near = {s: v + 0.01 for s, v in base.items()}
    far = {s: v + (0.5 if s <= 10 else -0.02) for s, v in base.items()}
    return {name: _fake_run(tmp_path / name, curve) for name, curve in (("base", base), ("near", near), ("far", far))}


def _main(args: list) -> int:
    return lc.main([str(a) for a in args])


def test_reads_losses_from_dump_folder_or_tb_folder(runs):
    from_dump = lc.read_losses(runs["base"])
    from_tb = lc.read_losses(runs["base"] / "tb")
    assert from_dump == from_tb
    assert sorted(from_dump) == list(range(1, 31))
    assert from_dump[10] == pytest.approx(2.9, abs=1e-6)  # TensorBoard stores float32


def test_gap_summary_over_the_last_steps(runs):
    curves = {name: lc.read_losses(path) for name, path in runs.items()}
    near, far = lc.summarize_gaps(curves, last=20)
    assert near.label == "near" and near.steps == list(range(11, 31))
    # float32 storage: ~1e-6 absolute error per value.
    assert near.mean_abs_gap == pytest.approx(0.01, abs=1e-5)
    assert far.mean_abs_gap == pytest.approx(0.02, abs=1e-5)
    assert far.mean_gap == pytest.approx(-0.02, abs=1e-5)
    # A window reaching into steps 1..10: (5 * 0.5 + 20 * 0.02) / 25.
    (_, far25) = lc.summarize_gaps(curves, last=25)
    assert far25.mean_abs_gap == pytest.approx((5 * 0.5 + 20 * 0.02) / 25, abs=1e-5)


def test_only_steps_logged_by_every_run_count():
    curves = {"a": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, "b": {2: 1.5, 4: 1.1, 5: 9.0}}
    assert lc.common_steps(curves) == [2, 4]
    (gap,) = lc.summarize_gaps(curves, last=20)
    assert gap.steps == [2, 4] and gap.mean_abs_gap == pytest.approx(0.3) and gap.final_gap == pytest.approx(0.1)
    with pytest.raises(lc.CompareError, match="share no logged step"):
        lc.summarize_gaps({"a": {1: 1.0}, "b": {2: 1.0}}, last=20)


def test_table_defaults_to_beside_the_plot(runs, tmp_path):
    out = tmp_path / "plots" / "loss.png"
    assert _main(["--runs", runs["base"], runs["near"], "--out", out]) == 0
    assert out.is_file() and (tmp_path / "plots" / "loss.md").is_file()


def test_within_tolerance_exits_0_and_writes_png_and_table(runs, tmp_path, capsys):
    out, table = tmp_path / "plots" / "loss.png", tmp_path / "gap.md"
    rc = _main(["--runs", runs["base"], runs["near"], runs["far"], "--tolerance", "0.05", "--out", out, "--table", table])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = table.read_text()
    near_label = str(runs["near"])
    assert f"| {near_label} | 0.0100 | +0.0100 | +0.0100 | yes |" in text
    # One row per common step: step 30 with base 2.7, near 2.71 and far 2.68.
    assert "| 30 | 2.7000 | 2.7100 | +0.0100 | 2.6800 | -0.0200 |" in text
    printed = capsys.readouterr().out
    assert "mean over the last 20 common steps (11..30)" in printed
    assert "mean |gap| 0.0200" in printed


def test_exceeding_tolerance_exits_1_naming_the_config(runs, tmp_path, capsys):
    rc = _main(["--runs", runs["base"], runs["near"], runs["far"], "--tolerance", "0.015",
                "--out", tmp_path / "l.png", "--table", tmp_path / "g.md"])
    assert rc == 1
    err = capsys.readouterr().err
    # Only 'far' (0.02) is named; 'near' (0.01) is within tolerance.
    assert err.strip() == f"error: mean |loss gap| to {runs['base']} exceeds 0.015 for: {runs['far']}"
    # The window decides: over the last 25 steps 'far' averages 0.116 and fails a 0.05 tolerance too.
    assert _main(["--runs", runs["base"], runs["far"], "--last", "25", "--out", tmp_path / "l.png",
                  "--table", tmp_path / "g.md"]) == 1
    assert _main(["--runs", runs["base"], runs["far"], "--last", "20", "--out", tmp_path / "l.png",
                  "--table", tmp_path / "g.md"]) == 0


def test_unusable_input_exits_2(runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert _main(["--runs", runs["base"], tmp_path / "empty", "--out", tmp_path / "l.png"]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err
    assert not (tmp_path / "l.png").exists()


def test_cli_rejects_bad_arguments(runs, capsys):
    with pytest.raises(SystemExit):
        _main(["--runs", runs["base"]])
    assert "at least two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main(["--runs", runs["base"], runs["near"], "--", "--training.steps", "3"])
    assert "apply to --configs runs only" in capsys.readouterr().err


def test_passthrough_overrides_the_script_controls_are_refused():
    with pytest.raises(lc.CompareError, match="--job.dump_folder is set by loss_compare"):
        lc.check_passthrough(["--job.dump_folder", "x"], steps=None)
    with pytest.raises(lc.CompareError, match="--metrics.log_freq is set by loss_compare"):
        lc.check_passthrough(["--metrics.log_freq=10"], steps=None)
    with pytest.raises(lc.CompareError, match="give the number of steps once"):
        lc.check_passthrough(["--training.steps", "3"], steps=5)
    lc.check_passthrough(["--training.steps", "3", "--model.n_layers", "2"], steps=None)


def test_train_command_logs_every_step_into_the_run_folder(tmp_path):
    cmd = lc.train_command("llama3_debug_fp8", tmp_path / "r", steps=7, overrides=["--metrics.cpu_peak_tflops", "1"],
                           nproc=1)
    assert cmd[:4] == [sys.executable, str(REPO / "train.py"), "--config", "llama3_debug_fp8"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {"--metrics.cpu_peak_tflops": "1", "--job.dump_folder": str(tmp_path / "r"),
                     "--metrics.log_freq": "1", "--metrics.enable_tensorboard": "true",
                     "--metrics.save_tb_folder": "tb", "--metrics.rank_0_only": "true", "--training.steps": "7"}
    assert lc.train_command("x", tmp_path, steps=None, overrides=[], nproc=2)[0] == str(REPO / "run_train.sh")


def test_run_folders_not_written_by_the_script_are_never_cleared(tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / "checkpoint").mkdir(parents=True)
    with pytest.raises(lc.CompareError, match="was not written by loss_compare"):
        lc.prepare_run_folder(foreign)
    assert (foreign / "checkpoint").is_dir()
    own = tmp_path / "own"
    lc.prepare_run_folder(own)
    (own / "tb").mkdir()
    lc.prepare_run_folder(own)  # a rerun starts from an empty folder: no stale events, no resume
    assert sorted(p.name for p in own.iterdir()) == [lc.OWNED_MARKER]


@pytest.mark.slow
def test_two_real_configs_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, table = tmp_path / "loss.png", tmp_path / "gap.md"
    rc = _main(["--configs", "llama3_debug", "llama3_debug_fp8", "--dump-root", tmp_path / "runs", "--out", out,
                "--table", table, "--", "--precision.param_dtype", "float32", "--model.n_layers", "1",
                "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "3",
                "--validation.enable", "false", "--metrics.cpu_peak_tflops", "1"])
    assert rc == 0, capsys.readouterr()
    for config in ("llama3_debug", "llama3_debug_fp8"):
        assert sorted(lc.read_losses(tmp_path / "runs" / config)) == [1, 2, 3]
    assert out.read_bytes()[:4] == b"\x89PNG"
    # Same seed, data and init; FP8 on 64 tokens moves the loss by ~1e-4 (measured), far below 0.05.
    (gap,) = lc.summarize_gaps({c: lc.read_losses(tmp_path / "runs" / c) for c in ("llama3_debug", "llama3_debug_fp8")},
                               last=20)
    assert 0.0 < gap.mean_abs_gap < 0.05
    assert "| llama3_debug_fp8 |" in table.read_text()
