"""scripts/fp8_sqnr.py --check (torchtitan_lite/tools/fp8_gates.py): every shipped FP8 recipe passes its layer
gates, and every planted fault (fp8_faults.py) fails at least the gate that its bug must move."""
from __future__ import annotations

import math

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.tools import fp8_gates as gates
from torchtitan_lite.tools import fp8_sqnr as sq
from torchtitan_lite.tools import fp8_sqnr_cli as cli
from torchtitan_lite.tools.fp8_faults import FAULTS, plant

# The gate each fault must fail on every recipe it applies to, and why that one:
EXPECTED_GATE = {
    # Truncation doubles the RMS rounding error and biases it: ~7 dB off every forward output.
    "round_toward_zero": "output",
    # A one-step-late amax under-scales what grew since (the loud token doubles between batches) and the cast
    # does not clamp: elements beyond the format's maximum.
    "stale_amax": "saturation",
    # ~1e-6 gradients cast with scale 1 fall below e4m3's and e5m2's smallest subnormals: the input gradient is 0.
    "unscaled_gradient_casts": "grad_input",
    # 2 mantissa bits instead of 3: ~6 dB off the forward output.
    "e5m2_forward": "output",
    # Per-column gradient scales let the loud token set the scale of every quiet token's row.
    "wrong_axis": "grad_input",
    # Scales read from the wrong tiles: the forward output is wrong by whole factors.
    "tiles_1x64": "output",
    # The loud token's expert sets every expert's weight-gradient scale: the quiet experts' gradients lose it all.
    "shared_expert_scale": "grad_weight",
}
CASES = [(fault, recipe) for fault in FAULTS for recipe in FAULTS[fault].applies_to]


def test_every_shipped_recipe_passes_its_gates():
    results, failures = gates.run_check(list(gates.RECIPES))
    assert failures == [], "\n".join(str(f) for f in failures)
    # Every recipe's every layer kind was probed and has a floor (the table covers the probe, and only it).
    probed = {(r.recipe, r.kind) for r in results}
    assert probed == {(recipe, kind) for recipe, kinds in gates.MEASURED_DB.items() for kind in kinds}
    assert set(gates.MEASURED_DB) == set(gates.RECIPES)
    for r in results:
        assert r.saturated == 0.0, (r.recipe, r.layer)
        # Not vacuous: FP8 ran (a high-precision twin would be exact or far above 40 dB).
        assert 25.0 < r.db["output"] < 40.0, (r.recipe, r.layer, r.db["output"])


@pytest.mark.parametrize("fault, recipe", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_every_planted_fault_fails_the_gates(fault, recipe):
    results = gates.probe(recipe, lambda model: plant(fault, model))
    failures = gates.check(results)
    failed = {f.gate for f in failures}
    # The same probe without the fault passes every gate (test_every_shipped_recipe_passes_its_gates): the fault,
    # not the probe, fails it.
    assert EXPECTED_GATE[fault] in failed, f"{fault} on {recipe} failed only {sorted(failed)}"


def test_the_fault_registry_covers_every_recipe_and_names_why_not():
    from torchtitan_lite.tools import fp8_faults

    assert fp8_faults.ALL_RECIPES == gates.RECIPES
    assert set(EXPECTED_GATE) == set(FAULTS)
    for fault in FAULTS.values():
        assert fault.applies_to and set(fault.applies_to) <= set(gates.RECIPES)
        assert set(fault.not_applicable) == set(gates.RECIPES) - set(fault.applies_to), fault.name
        assert all(reason for reason in fault.not_applicable.values())
    with pytest.raises(ValueError, match="unknown planted fault 'nope'; choose one of: round_toward_zero"):
        plant("nope", None)


def test_a_failed_gate_names_recipe_layer_tensor_and_numbers():
    failure = gates.GateFailure("rowwise", "layers.0.attention.wq", "grad_input", 14.93, 27.45)
    assert str(failure) == ("rowwise layers.0.attention.wq grad_input: SQNR 14.9 dB is below its floor 27.4 dB")
    assert str(gates.GateFailure("tensorwise", "l", "saturation", 1e-4, 0.0)) == (
        "tensorwise l saturation: 0.01% of the cast elements, more than the bound 0.00%")
    # An overflowed cast (NaN SQNR) fails its floor; a high-precision weight gradient (inf) passes HIGH_PRECISION_DB.
    nan = gates.LayerResult("rowwise", "layers.0.attention.wq", "attention.wq",
                            {"output": math.nan, "grad_input": 28.4, "grad_weight": 28.6}, 0.0, 0.0)
    assert [f.gate for f in gates.check([nan])] == ["output"]
    hp = gates.LayerResult("rowwise_with_gw_hp", "l", "attention.wq",
                           {"output": 28.4, "grad_input": 28.5, "grad_weight": math.inf}, 0.0, 0.0)
    assert gates.check([hp]) == []
    assert gates.floor_db("rowwise_with_gw_hp", "attention.wq", "grad_weight") == gates.HIGH_PRECISION_DB


def test_cli_check_passes_and_a_planted_fault_fails_it(capsys):
    assert cli.main(["--check", "--recipes", "tensorwise"], registry=DEFAULT_REGISTRY) == 0
    out = capsys.readouterr().out
    assert "every gate passed" in out and "layers.0.feed_forward.w2" in out
    assert cli.main(["--check", "--recipes", "tensorwise", "--fault", "e5m2_forward"], registry=DEFAULT_REGISTRY) == 1
    out = capsys.readouterr().out
    assert "with planted fault e5m2_forward" in out
    assert "FAIL tensorwise layers.0.attention.wq output: SQNR 22.4 dB is below its floor 27.4 dB" in out


def test_cli_check_refusals_name_the_fix(capsys):
    assert cli.main(["--check", "--recipes", "fp4"], registry=DEFAULT_REGISTRY) == 2
    assert "unknown FP8 recipe(s) fp4; choose from: tensorwise" in capsys.readouterr().err
    assert cli.main(["--check", "--recipes", "mxfp8", "--fault", "stale_amax"], registry=DEFAULT_REGISTRY) == 2
    assert "fault 'stale_amax' applies to none of mxfp8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sq.main(["--fault", "stale_amax", "--config", "llama3_debug_fp8"], registry=DEFAULT_REGISTRY)
    assert "--recipes and --fault go with --check" in capsys.readouterr().err
