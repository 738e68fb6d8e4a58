"""scripts/loss_compare.py (torchtitan_lite/tools/loss_compare.py): gap arithmetic, exit codes and outputs on fake runs,
plus one real comparison."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchtitan_lite.tools import loss_compare as lc
from torchtitan_lite.tools import loss_compare_runs as runs_mod

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
        runs_mod.check_passthrough(["--job.dump_folder", "x"], steps=None)
    with pytest.raises(lc.CompareError, match="--metrics.log_freq is set by loss_compare"):
        runs_mod.check_passthrough(["--metrics.log_freq=10"], steps=None)
    with pytest.raises(lc.CompareError, match="give the number of steps once"):
        runs_mod.check_passthrough(["--training.steps", "3"], steps=5)
    runs_mod.check_passthrough(["--training.steps", "3", "--model.n_layers", "2"], steps=None)


def test_train_command_logs_every_step_into_the_run_folder(tmp_path):
    cmd = runs_mod.train_command("llama3_debug_fp8", tmp_path / "r", steps=7, overrides=["--metrics.cpu_peak_tflops", "1"],
                           nproc=1)
    assert cmd[:4] == [sys.executable, str(REPO / "train.py"), "--config", "llama3_debug_fp8"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    # Checkpointing is off: the comparison reads only TensorBoard scalars.
    assert flags == {"--metrics.cpu_peak_tflops": "1", "--job.dump_folder": str(tmp_path / "r"),
                     "--metrics.log_freq": "1", "--metrics.enable_tensorboard": "true",
                     "--metrics.save_tb_folder": "tb", "--metrics.rank_0_only": "true", "--training.steps": "7",
                     "--checkpoint.enable": "false"}
    assert runs_mod.train_command("x", tmp_path, steps=None, overrides=[], nproc=2)[0] == str(REPO / "run_train.sh")


def test_checkpoints_only_when_the_overrides_ask_and_seed_is_passed(tmp_path):
    asked = runs_mod.train_command("c", tmp_path, steps=None, overrides=["--checkpoint.enable", "true"], nproc=1, seed=2)
    flags = dict(zip(asked[4::2], asked[5::2]))
    assert flags["--checkpoint.enable"] == "true" and asked.count("--checkpoint.enable") == 1
    assert flags["--training.seed"] == "2"
    asked_eq = runs_mod.train_command("c", tmp_path, steps=None, overrides=["--checkpoint.enable=true"], nproc=1)
    assert "--checkpoint.enable" not in asked_eq and "--training.seed" not in asked_eq
    with pytest.raises(lc.CompareError, match="--seeds 3 sets training.seed to 0..2"):
        runs_mod.check_passthrough(["--training.seed", "5"], steps=None, seeds=3)
    runs_mod.check_passthrough(["--training.seed", "5"], steps=None, seeds=1)


def test_run_folders_not_written_by_the_script_are_never_cleared(tmp_path):
    foreign = tmp_path / "foreign"
    (foreign / "checkpoint").mkdir(parents=True)
    with pytest.raises(lc.CompareError, match="was not written by loss_compare"):
        runs_mod.prepare_run_folder(foreign)
    assert (foreign / "checkpoint").is_dir()
    own = tmp_path / "own"
    runs_mod.prepare_run_folder(own)
    (own / "tb").mkdir()
    runs_mod.prepare_run_folder(own)  # a rerun starts from an empty folder: no stale events, no resume
    assert sorted(p.name for p in own.iterdir()) == [runs_mod.OWNED_MARKER]


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
        # llama3_debug checkpoints every 100 steps and at the last one; the comparison turns it off.
        assert not (tmp_path / "runs" / config / "checkpoint").exists()
    printed = capsys.readouterr().out
    assert "[loss_compare] run 2/2 llama3_debug_fp8: step 3/3, " in printed
    assert out.read_bytes()[:4] == b"\x89PNG"
    # Same seed, data and init; FP8 on 64 tokens moves the loss by ~1e-4 (measured), far below 0.05.
    (gap,) = lc.summarize_gaps({c: lc.read_losses(tmp_path / "runs" / c) for c in ("llama3_debug", "llama3_debug_fp8")},
                               last=20)
    assert 0.0 < gap.mean_abs_gap < 0.05
    assert "| llama3_debug_fp8 |" in table.read_text()


def test_a_run_streams_progress_lines_and_keeps_its_log(tmp_path, monkeypatch, capsys):
    # A stand-in for train.py that prints the trainer's lines for 50 steps.
    script = ("print('training 50 steps from step 0, 1 micro-batch(es) per step')\n"
              "for k in range(1, 51):\n"
              "    print(f'[rank0] INFO torchtitan_lite: step {k:6d}  loss   5.0000  grad_norm  1.0')\n")
    monkeypatch.setattr(runs_mod, "train_command", lambda *a, **k: [sys.executable, "-c", script])
    runs_mod.run_config("llama3_debug_fp8", tmp_path / "run", steps=None, overrides=[], nproc=1, seed=1,
                  label="run 4/6 llama3_debug_fp8 seed 1", progress_every=3600.0)
    printed = capsys.readouterr().out.splitlines()
    progress = [line for line in printed if line.startswith("[loss_compare] run 4/6 llama3_debug_fp8 seed 1: step ")]
    # An hour between lines: only the first and the last step are shown, not 50 lines.
    assert [line.split(", ")[0] for line in progress] == ["[loss_compare] run 4/6 llama3_debug_fp8 seed 1: step 1/50",
                                                          "[loss_compare] run 4/6 llama3_debug_fp8 seed 1: step 50/50"]
    assert printed[-1].startswith("[loss_compare] run 4/6 llama3_debug_fp8 seed 1: done in ")
    assert (tmp_path / "run" / "train.log").read_text().count(" loss ") == 50


def test_seeds_train_each_config_per_seed_into_its_own_folder(tmp_path, monkeypatch, capsys):
    trained = []

    def fake_run(config, dump, *, seed, label, **kwargs):
        trained.append((label, dump.relative_to(tmp_path), seed))

    # bf16's three seeds differ by 0.1; fp8 is 0.3 above bf16 on every seed.
    offsets = {"bf16": 0.0, "fp8": 0.3}
    monkeypatch.setattr(lc, "run_config", fake_run)
    monkeypatch.setattr(lc, "read_losses", lambda dump, tag: {s: 3.0 + offsets[dump.parent.name] +
                                                         0.1 * int(dump.name.removeprefix("seed-")) for s in range(1, 6)})
    rc = _main(["--configs", "bf16", "fp8", "--seeds", "3", "--dump-root", tmp_path, "--out", tmp_path / "l.png"])
    assert rc == 1
    # Seed by seed, so that a cut-off comparison leaves whole seeds.
    assert trained == [("run 1/6 bf16 seed 0", Path("bf16/seed-0"), 0), ("run 2/6 fp8 seed 0", Path("fp8/seed-0"), 0),
                       ("run 3/6 bf16 seed 1", Path("bf16/seed-1"), 1), ("run 4/6 fp8 seed 1", Path("fp8/seed-1"), 1),
                       ("run 5/6 bf16 seed 2", Path("bf16/seed-2"), 2), ("run 6/6 fp8 seed 2", Path("fp8/seed-2"), 2)]
    out = capsys.readouterr()
    assert "noise band (its seed-to-seed std. dev.) 0.1000" in out.out
    assert "fp8: mean gap +0.3000 ± 0.0000 (seeds 0 +0.3000, 1 +0.3000, 2 +0.3000) -> beyond noise" in out.out
    assert out.err.strip() == "error: loss gap to bf16 beyond its seed-to-seed noise for: fp8"


def test_parallel_trains_p_runs_at_once_with_a_share_of_the_cores_each(tmp_path, monkeypatch, capsys):
    import threading
    import time

    lock, running, peak, calls = threading.Lock(), [0], [0], []

    def fake_run(config, dump, *, seed, label, cpu_threads, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            calls.append((label, cpu_threads))
        time.sleep(0.2)   # long enough for the pool to start every run it may
        with lock:
            running[0] -= 1

    monkeypatch.setattr(lc, "run_config", fake_run)
    monkeypatch.setattr(lc.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(lc, "read_losses", lambda dump, tag: {s: 3.0 + 0.1 * int(dump.name.removeprefix("seed-"))
                                                         for s in range(1, 6)})
    rc = _main(["--configs", "bf16", "fp8", "--seeds", "3", "--parallel", "3", "--dump-root", tmp_path,
                "--out", tmp_path / "l.png"])
    assert rc == 0   # identical curves per seed: gap 0, within noise
    assert peak[0] == 3
    assert sorted(calls) == sorted((f"run {n}/6 {c} seed {s}", 16 // 3) for n, (c, s) in
                                   enumerate([(c, s) for s in range(3) for c in ("bf16", "fp8")], start=1))


def test_after_a_failed_run_no_further_run_starts(tmp_path, monkeypatch, capsys):
    started = []

    def fake_run(config, dump, *, seed, label, **kwargs):
        started.append(label)
        if label.startswith("run 2/"):
            raise lc.CompareError("training fp8 failed (exit 1)")

    monkeypatch.setattr(lc, "run_config", fake_run)
    rc = _main(["--configs", "bf16", "fp8", "--seeds", "3", "--dump-root", tmp_path, "--out", tmp_path / "l.png"])
    assert rc == 2
    assert started == ["run 1/6 bf16 seed 0", "run 2/6 fp8 seed 0"]
    assert "training fp8 failed (exit 1)" in capsys.readouterr().err


def test_parallel_is_refused_where_it_cannot_apply(runs, capsys):
    for args, text in ((["--configs", "a", "b", "--parallel", "0"], "--parallel must be >= 1, got 0"),
                       (["--configs", "a", "b", "--parallel", "2", "--nproc", "2"], "use one or the other"),
                       (["--runs", runs["base"], runs["near"], "--parallel", "2"], "--runs reads finished runs")):
        with pytest.raises(SystemExit):
            _main(args)
        assert text in capsys.readouterr().err


@pytest.fixture
def seed_runs(tmp_path):
    # Seed s draws its own batches: a per-seed wobble shared by every config of that seed, summing to 0 over
    # each 4 steps (so over the 20-step window).
    wobble = {"0": [0.3, -0.2, 0.1, -0.2], "1": [-0.1, 0.4, -0.3, 0.0], "2": [0.0, 0.1, 0.3, -0.4]}
    offsets = {"bf16": {"0": 0.0, "1": 0.05, "2": -0.05}, "biased": {"0": 0.3, "1": 0.36, "2": 0.25},
               "noisy": {"0": 0.08, "1": -0.02, "2": -0.1}}
    folders = {}
    for config, per_seed in offsets.items():
        for seed, offset in per_seed.items():
            _fake_run(tmp_path / config / f"seed-{seed}",
                      {s: 3.0 - 0.01 * s + wobble[seed][s % 4] + offset for s in range(1, 41)})
        folders[config] = tmp_path / config
    return folders


def test_runs_of_several_seeds_are_judged_against_the_baseline_spread(seed_runs, tmp_path, capsys):
    table = tmp_path / "gap.md"
    rc = _main(["--runs", seed_runs["bf16"], seed_runs["noisy"], "--out", tmp_path / "l.png", "--table", table])
    assert rc == 0, capsys.readouterr().err
    text = table.read_text()
    # bf16's window means differ by its offsets 0, 0.05, -0.05: std 0.05. noisy's gaps 0.08, -0.07, -0.05:
    # mean -0.0133, stdev 0.0815, standard error 0.0815 / sqrt(3) = 0.0470.
    assert "over its 3 seeds, 0.0500" in text
    assert f"| {seed_runs['noisy']} | 0, 1, 2 | -0.0133 ± 0.0470 | +0.0800, -0.0700, -0.0500 | within noise |" in text
    assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"
    rc = _main(["--runs", seed_runs["bf16"], seed_runs["noisy"], seed_runs["biased"], "--out", tmp_path / "l.png",
                "--table", table])
    assert rc == 1
    # Gaps 0.30, 0.31, 0.30: mean 0.3033, stdev 0.00577, error 0.0033; 0.3033 - 0.0033 > 0.05.
    assert f"| {seed_runs['biased']} | 0, 1, 2 | +0.3033 ± 0.0033 | +0.3000, +0.3100, +0.3000 | **beyond noise** |" \
        in table.read_text()
    assert capsys.readouterr().err.strip() == \
        f"error: loss gap to {seed_runs['bf16']} beyond its seed-to-seed noise for: {seed_runs['biased']}"


def test_seed_runs_need_seeds_in_common(seed_runs, runs, tmp_path, capsys):
    assert _main(["--runs", seed_runs["bf16"], runs["near"], "--out", tmp_path / "l.png"]) == 2
    assert "shares 0 seed(s) with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main(["--runs", seed_runs["bf16"], seed_runs["noisy"], "--seeds", "3"])
    assert "with --runs give folders that hold seed-<s> runs instead" in capsys.readouterr().err


def test_another_scalar_can_be_compared(runs, tmp_path, capsys):
    # The fake runs log train/lr = 1e-3 on every step: no gap at all on that tag.
    assert _main(["--runs", runs["base"], runs["far"], "--tag", "train/lr", "--last", "1", "--out", tmp_path / "l.png"]) == 0
    assert f"{runs['far']}: mean |gap| 0.0000" in capsys.readouterr().out
    assert _main(["--runs", runs["base"], runs["far"], "--tag", "val/loss", "--out", tmp_path / "l.png"]) == 2
    assert "has no 'val/loss' scalar" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["llama3_debug", "llama3_debug_fp8"])
def test_the_train_command_of_a_real_config_parses_to_a_run_logging_every_step_where_the_script_reads(config, tmp_path):
    # The default suite's cover of test_two_real_configs_end_to_end (slow, two real trainings): the command the
    # script launches is accepted by the real config and resolves to TensorBoard scalars every step, no
    # checkpoints, in the folder read_losses reads. That train.py writes train/loss there is the integration
    # tests' (tests/integration/_cli.py read_scalars).
    from config_registry import DEFAULT_REGISTRY
    from torchtitan_lite.config import parse_cli

    dump = tmp_path / "run"
    cmd = runs_mod.train_command(config, dump, steps=3, overrides=["--model.n_layers", "1"], nproc=1)
    parsed = parse_cli(cmd[2:], registry=DEFAULT_REGISTRY).config
    m = parsed.metrics
    assert (m.log_freq, m.enable_tensorboard, m.rank_0_only, parsed.training.steps, parsed.checkpoint.enable,
            parsed.model.n_layers) == (1, True, True, 3, False, 1)
    (Path(parsed.job.dump_folder) / m.save_tb_folder).mkdir(parents=True)  # where train.py's writer puts it
    assert runs_mod.tensorboard_folder(dump) == dump / m.save_tb_folder
