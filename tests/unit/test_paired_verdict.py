"""The paired FP8 verdict: Student's t quantiles, PASS / FAIL / UNDECIDED against δ, the two controls that make
a verdict count, and the report and exit status of scripts/loss_compare.py --verdict (runs stubbed: the
statistics are exact, so the expected verdicts are known)."""
import math

import pytest

from torchtitan_lite.tools import fp8_verdict
from torchtitan_lite.tools.paired_verdict import FAIL, INCONCLUSIVE, PASS, UNDECIDED, Verdicts, paired, statistic, t_quantile


@pytest.mark.parametrize("df, table", [(1, 6.3138), (2, 2.9200), (3, 2.3534), (5, 2.0150), (10, 1.8125), (30, 1.6973)])
def test_t_quantile_matches_the_published_table(df, table):
    # Tables print 4 decimals; the quadrature is good to ~1e-9, so 1e-4 is the table's rounding.
    assert t_quantile(0.95, df) == pytest.approx(table, abs=1e-4)


def test_t_quantile_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="at least 1 degree of freedom"):
        t_quantile(0.95, 0)
    with pytest.raises(ValueError, match=r"must lie in \(0.5, 1\)"):
        t_quantile(0.3, 3)


def _seeds(*values):
    return {str(i): v for i, v in enumerate(values)}


BASE = _seeds(4.60, 4.55, 4.70, 4.62)


def test_pass_fail_and_undecided_against_delta():
    # Gaps 0.010, 0.012, 0.008, 0.010: mean 0.010, SE 0.000816, t(0.95, 3) x SE = 0.00192.
    recipe = {s: BASE[s] + g for s, g in zip(BASE, (0.010, 0.012, 0.008, 0.010))}
    v = paired("r vs b", recipe, BASE, delta=0.02)
    assert v.mean == pytest.approx(0.010)
    assert v.std_error == pytest.approx(math.sqrt(8e-6 / 3) / 2)
    assert v.upper == pytest.approx(0.010 + 2.3534 * v.std_error, abs=1e-6)
    assert v.outcome == PASS
    assert paired("r vs b", recipe, BASE, delta=0.005).outcome == FAIL
    # δ inside the interval: neither bound decides.
    assert paired("r vs b", recipe, BASE, delta=0.0105).outcome == UNDECIDED


def test_the_interval_is_t_wide_not_one_standard_error():
    """δ between mean + SE and mean + t x SE: one standard error would PASS a recipe the 95% bound cannot."""
    recipe = {s: BASE[s] + g for s, g in zip(BASE, (0.010, 0.012, 0.008, 0.010))}
    v = paired("r vs b", recipe, BASE, delta=0.0112)
    assert v.mean + v.std_error < 0.0112 < v.upper
    assert v.outcome == UNDECIDED


def test_paired_needs_two_shared_seeds():
    with pytest.raises(ValueError, match="at least 2 seeds both arms ran"):
        paired("r vs b", {"0": 4.6, "7": 4.7}, BASE, delta=0.02)


def _verdicts(control_gap, fault_gap, recipe_gap, delta=0.02):
    def shifted(gap, base=BASE):
        return {s: base[s] + gap + 0.001 * i for i, s in enumerate(base)}  # a small spread per seed
    fp32 = {s: v - control_gap for s, v in BASE.items()}
    return Verdicts(control=paired("bf16 vs fp32", BASE, fp32, delta),
                    fault=paired("fault vs bf16", shifted(fault_gap), BASE, delta),
                    recipes=[paired("tensorwise vs bf16", shifted(recipe_gap), BASE, delta)])


def test_a_verdict_counts_only_when_both_controls_behave():
    good = _verdicts(control_gap=0.0, fault_gap=0.2, recipe_gap=0.0)
    assert good.controls_behave and good.final(good.recipes[0]) == PASS
    assert fp8_verdict.exit_code(good) == fp8_verdict.EXIT_PASS
    failing = _verdicts(control_gap=0.0, fault_gap=0.2, recipe_gap=0.1)
    assert failing.final(failing.recipes[0]) == FAIL and fp8_verdict.exit_code(failing) == fp8_verdict.EXIT_FAIL
    blind = _verdicts(control_gap=0.0, fault_gap=0.0, recipe_gap=0.0)  # the fault arm does not FAIL
    assert blind.final(blind.recipes[0]) == INCONCLUSIVE
    assert fp8_verdict.exit_code(blind) == fp8_verdict.EXIT_INCONCLUSIVE
    assert "cannot see a bug" in blind.why_inconclusive()[0]
    tight = _verdicts(control_gap=0.1, fault_gap=0.2, recipe_gap=0.0)  # BF16 itself fails δ
    assert tight.final(tight.recipes[0]) == INCONCLUSIVE
    assert "tighter than a known-good precision step" in tight.why_inconclusive()[0]


def test_statistic_is_the_mean_at_the_eval_steps_and_names_missing_ones():
    assert statistic({25: 9.0, 50: 4.9, 75: 4.6, 100: 4.5}, (50, 75, 100), "run") == pytest.approx(4.6667, abs=1e-4)
    with pytest.raises(ValueError, match=r"run has no validation loss at step\(s\) \[100\]"):
        statistic({25: 9.0, 50: 4.9, 75: 4.6}, (50, 75, 100), "run")


def test_verdict_cli_report_and_exit_status(tmp_path, monkeypatch, capsys):
    """Training stubbed with fixed statistics: a clean recipe PASSes, a costly one FAILs, the report says so."""
    gaps = {"fp32": 0.0, "bf16": 0.0, "tensorwise": 0.002, "rowwise": 0.08}

    def fake_train(args, arms, overrides):
        stats = {}
        for arm in arms:
            gap = 0.3 if arm.fault else gaps[arm.name]
            stats[arm.name] = {str(s): 4.6 + 0.05 * s + gap + 0.001 * (s % 2) for s in range(args.seeds)}
        return stats, {arm.name: [1.0] * args.seeds for arm in arms}

    monkeypatch.setattr(fp8_verdict, "train_arms", fake_train)
    table = tmp_path / "verdict.md"
    code = fp8_verdict.main(["--verdict", "llama3", "--recipes", "tensorwise", "rowwise", "--seeds", "4",
                             "--table", str(table)])
    assert code == fp8_verdict.EXIT_FAIL
    text = table.read_text()
    assert "| tensorwise vs bf16 | +0.0020 |" in text and "**PASS** |" in text
    assert "| rowwise vs bf16 | +0.0800 |" in text and "**FAIL** |" in text
    assert "fault-round_toward_zero-tensorwise vs bf16 | +0.3000" in text
    assert "llama3: tensorwise PASS, rowwise FAIL" in capsys.readouterr().out


def _arms_run(monkeypatch, argv):
    """The arms ``argv`` trains (names -> configs), training stubbed."""
    seen = {}

    def fake_train(args, arms, overrides):
        seen.update((arm.name, arm.config) for arm in arms)
        stats = {arm.name: {str(s): 4.6 + 0.05 * s + (0.3 if arm.fault else 0.0) for s in range(args.seeds)}
                 for arm in arms}
        return stats, {arm.name: [1.0] * args.seeds for arm in arms}

    monkeypatch.setattr(fp8_verdict, "train_arms", fake_train)
    fp8_verdict.main(argv)
    return seen


def test_the_fp8_head_is_an_arm_of_its_own_and_the_default_verdict_keeps_its_arms(tmp_path, monkeypatch):
    common = ["--verdict", "llama3", "--seeds", "2", "--dump-root", str(tmp_path)]
    default = _arms_run(monkeypatch, common)
    assert list(default) == ["fp32", "bf16", "fault-round_toward_zero-tensorwise", "tensorwise", "rowwise", "mxfp8",
                             "blockwise", "fp16"]
    head = _arms_run(monkeypatch, [*common, "--recipes", "tensorwise_head"])
    assert list(head)[3:] == ["tensorwise_head"] and head["tensorwise_head"] == "llama3_debug_fp8_head"


def test_every_verdict_arm_is_a_registered_config():
    import config_registry
    from torchtitan_lite.tools.fp8_verdict_setups import SETUPS

    names = set(config_registry.names())
    for setup in SETUPS.values():
        assert {setup.reference, setup.baseline, *setup.recipes.values()} <= names, setup.family
        assert set(setup.default_recipes) <= set(setup.recipes) and setup.fault_recipe in setup.recipes


def test_verdict_cli_refuses_bad_input(capsys):
    with pytest.raises(SystemExit):
        fp8_verdict.main(["--verdict", "gpt2"])
    assert "no FP8 verdict setup for family 'gpt2'; choose one of: llama3, qwen3_moe, deepseek_v3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8_verdict.main(["--verdict", "llama3", "--recipes", "nvfp4"])
    assert "llama3 has no recipe nvfp4; choose from tensorwise" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8_verdict.main(["--verdict", "llama3", "--seeds", "1"])
    assert "--seeds must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8_verdict.main(["--verdict", "llama3", "--fault", "bitflip"])
    assert "unknown planted fault 'bitflip'" in capsys.readouterr().err


def test_a_finished_run_is_reused_only_for_the_same_command(tmp_path):
    import json

    from torchtitan_lite.tools.loss_compare_runs import FINISHED, finished_wall_s, train_command

    dump = tmp_path / "tensorwise" / "seed-1"
    dump.mkdir(parents=True)
    assert finished_wall_s("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "4"], seed=1) is None
    cmd = train_command("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "4"], nproc=1, seed=1)
    (dump / FINISHED).write_text(json.dumps({"command": cmd[1:], "wall_s": 97.0}))
    assert finished_wall_s("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "4"], seed=1) == 97.0
    # Another layer count, seed or fault is another run.
    assert finished_wall_s("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "2"], seed=1) is None
    assert finished_wall_s("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "4"], seed=2) is None
    assert finished_wall_s("llama3_debug_fp8", dump, steps=None, overrides=["--model.n_layers", "4"], seed=1,
                           fault="round_toward_zero") is None
