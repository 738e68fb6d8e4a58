"""The expected FP8 speedup from a layer bench and a BF16 profile, on synthetic inputs with known answers, and
the profile's categories on records shaped like a real CUDA profile."""
from __future__ import annotations

import json

import pytest

from torchtitan_lite.tools import fp8_expectation as fx
from torchtitan_lite.tools.step_profile import ProfileRecord, StepProfile, categorize, classify, gemm_dims

VOCAB = 128256


def _rec(name: str, op: str, shapes=(), us: float = 1000.0, chain=()) -> ProfileRecord:
    return ProfileRecord(name, op, tuple(chain), tuple(tuple(s) for s in shapes), us)


def test_categories_of_kernels_as_a_cuda_profile_names_them():
    cases = {
        _rec("nvjet_tst_128x256", "aten::mm", [(8192, 4096), (4096, 14336)]): "gemm",
        _rec("nvjet_tst_128x256", "aten::mm", [(8192, 4096), (4096, VOCAB)]): "head",  # the output projection
        _rec("sm90_xmma_gemm_e4m3", "aten::_scaled_mm", [(8192, 4096), (4096, 4096)]): "fp8_gemm",
        _rec("flash_fwd_kernel", "aten::_flash_attention_forward",
             chain=["aten::_scaled_dot_product_flash_attention"]): "attention",
        _rec("triton_red_fused_abs_amax_0", "Torch-Compiled Region: 0/0"): "cast",
        _rec("triton_per_fused__log_softmax_1", "CompiledFunction"): "head",
        _rec("multi_tensor_apply_kernel", "aten::_fused_adamw_", chain=["Optimizer.step#AdamW.step"]): "optimizer",
        _rec("ncclDevKernel_AllReduce", "c10d::allreduce_"): "communication",
        _rec("triton_poi_fused_mul_silu_2", "CompiledFunction"): "other",
    }
    assert {r.name + "@" + r.op: classify(r, vocab_size=VOCAB) for r in cases} == {
        r.name + "@" + r.op: c for r, c in cases.items()}
    # The three GEMMs of one Linear (forward, input gradient, weight gradient) name the same sorted dimensions.
    assert {gemm_dims(s) for s in ([(8192, 4096), (4096, 1024)], [(8192, 1024), (1024, 4096)],
                                   [(1024, 8192), (8192, 4096)])} == {(1024, 4096, 8192)}
    assert gemm_dims([(1024,), (8192, 4096), (4096, 1024)]) == (1024, 4096, 8192)  # addmm: bias first
    # Compiled code calls mm(a, b, out=c): the output comes after the operands (as recorded on an H200).
    assert gemm_dims([(8192, 4096), (4096, 14336), (8192, 14336)]) == (4096, 8192, 14336)
    assert gemm_dims([(8192, 4096), (8192, 4096)]) is None


def test_cupti_markers_are_not_ops():
    """On an H200 the optimizer's kernels were listed under "Command Buffer Full" as well as under their op."""
    records = [_rec("multi_tensor_apply_kernel", "Command Buffer Full", us=4_000_000.0),
               _rec("multi_tensor_apply_kernel", "aten::_fused_adamw_", us=80_000.0,
                    chain=["Optimizer.step#AdamW.step"])]
    assert categorize(records, vocab_size=VOCAB, steps=2).ms["optimizer"] == pytest.approx(40.0)


def test_categorize_sums_per_step_and_keeps_gemm_time_per_shape():
    records = [_rec("k", "aten::mm", [(8192, 4096), (4096, 1024)], us=3000.0),
               _rec("k", "aten::mm", [(8192, 1024), (1024, 4096)], us=1000.0),
               _rec("flash", "aten::_flash_attention_backward", us=2000.0)]
    profile = categorize(records, vocab_size=VOCAB, steps=2)
    assert profile.ms["gemm"] == pytest.approx(2.0) and profile.ms["attention"] == pytest.approx(1.0)
    assert profile.gemm_ms == {(1024, 4096, 8192): pytest.approx(2.0)}
    assert profile.total_ms == pytest.approx(3.0)


def _layers(tensorwise_w1: float) -> list[fx.LayerTiming]:
    return [fx.LayerTiming("w1, w3", 8192, 4096, 14336, {"hp": 0.004, "tensorwise": 0.004 / tensorwise_w1}),
            fx.LayerTiming("wq, wo", 8192, 4096, 4096, {"hp": 0.002, "tensorwise": 0.002 / 1.25})]


def test_expected_speedup_is_the_bf16_step_less_what_each_converted_gemm_saves():
    # A 100 ms BF16 step: 40 ms in the w1/w3 GEMMs, 10 ms in wq/wo, 50 ms elsewhere.
    profile = StepProfile(ms={"gemm": 50.0, "other": 50.0},
                          gemm_ms={(4096, 8192, 14336): 40.0, (4096, 4096, 8192): 10.0}, steps=1)
    e = fx.expect("fp8", "tensorwise", bf16_step_ms=100.0, bf16_profile=profile, layers=_layers(2.0),
                  converted=[(4096, 14336), (4096, 4096)], measured_speedup=1.20)
    # Saved: 40 x (1 - 1/2) + 10 x (1 - 1/1.25) = 20 + 2 = 22 ms -> 100 / 78.
    assert e.saved_ms == pytest.approx(22.0) and e.expected_speedup == pytest.approx(100 / 78)
    assert e.converted_gemm_ms == pytest.approx(50.0)
    assert e.ratio == pytest.approx(1.20 / (100 / 78)) and e.short is False  # 0.936 of expected
    short = fx.expect("fp8", "tensorwise", bf16_step_ms=100.0, bf16_profile=profile, layers=_layers(2.0),
                      converted=[(4096, 14336), (4096, 4096)], measured_speedup=1.10)
    assert short.short is True  # 1.10 / 1.282 = 0.86 < 0.9
    # Only the Linears the run converted count: without wq/wo the expectation is 100 / 80.
    only_mlp = fx.expect("fp8", "tensorwise", bf16_step_ms=100.0, bf16_profile=profile, layers=_layers(2.0),
                         converted=[(4096, 14336)], measured_speedup=None)
    assert only_mlp.expected_speedup == pytest.approx(1.25) and only_mlp.ratio is None
    # A converted Linear the bench never timed is named, and counted as unchanged.
    unknown = fx.expect("fp8", "tensorwise", bf16_step_ms=100.0, bf16_profile=profile, layers=_layers(2.0),
                        converted=[(4096, 14336), (4096, 1024)], measured_speedup=None)
    assert unknown.unmatched == ["4096x1024"] and unknown.expected_speedup == pytest.approx(1.25)


def test_linears_whose_gemms_share_dimensions_share_one_profile_entry():
    """8B: w1/w3 (4096 -> 14336) and w2 (14336 -> 4096) all run GEMMs over {8192, 4096, 14336}; that profile time
    is counted once, at the three Linears' joint bench speedup (BF16 time over FP8 time)."""
    layers = [fx.LayerTiming("w1, w3", 8192, 4096, 14336, {"hp": 0.004, "tensorwise": 0.002}, count=2),
              fx.LayerTiming("w2", 8192, 14336, 4096, {"hp": 0.004, "tensorwise": 0.004}, count=1)]
    profile = StepProfile(ms={"gemm": 60.0, "other": 40.0}, gemm_ms={(4096, 8192, 14336): 60.0}, steps=1)
    e = fx.expect("fp8", "tensorwise", bf16_step_ms=100.0, bf16_profile=profile, layers=layers,
                  converted=[(4096, 14336), (14336, 4096)], measured_speedup=None)
    # Joint speedup 12 / 8 = 1.5: saves 60 x (1 - 1/1.5) = 20 ms -> 100 / 80.
    assert e.converted_gemm_ms == pytest.approx(60.0) and e.expected_speedup == pytest.approx(1.25)


def test_the_command_writes_the_table_and_shows_the_profiles_of_a_short_recipe(tmp_path):
    layers = {"rows": [{"name": "w1, w3", "m": 8192, "k": 4096, "n": 14336, "count": 2,
                        "seconds": {"hp": 0.004, "tensorwise": 0.002, "rowwise": 0.0032}}]}
    (tmp_path / "b.json").write_text(json.dumps(layers))
    rows = [{"config": "bf16", "step_ms": 100.0, "speedup": 1.0}, {"config": "tw", "step_ms": 85.0, "speedup": 1.18},
            {"config": "rw", "step_ms": 100.0, "speedup": 1.0}]
    (tmp_path / "e2e.json").write_text(json.dumps({"rows": rows}))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    mm = [_rec("nvjet", "aten::mm", [(8192, 4096), (4096, 14336)], us=80_000.0).to_json(),
          _rec("nvjet", "aten::mm", [(8192, 4096), (4096, VOCAB)], us=20_000.0).to_json()]
    fp8 = [_rec("xmma_e4m3", "aten::_scaled_mm", [(8192, 4096), (4096, 14336)], us=64_000.0).to_json(),
           _rec("triton_red_fused_abs_amax", "CompiledFunction", us=30_000.0).to_json()]
    for name, records in (("bf16", mm), ("tw", fp8), ("rw", fp8)):
        (profiles / f"{name}.json").write_text(json.dumps({"steps": 2, "vocab_size": VOCAB, "converted": [[4096, 14336]],
                                                           "records": records}))
    out = tmp_path / "x.md"
    assert fx.main(["--layer-bench", str(tmp_path / "b.json"), "--e2e", str(tmp_path / "e2e.json"), "--profiles",
                    str(profiles), "--baseline", "bf16", "--recipe", "tw=tensorwise", "--recipe", "rw=rowwise",
                    "--out-md", str(out), "--json-out", str(tmp_path / "x.json")]) == 0
    text = out.read_text()
    # BF16: 40 ms/step in w1/w3 GEMMs. tensorwise 2x -> saves 20 -> 100/80 = 1.25x expected, 1.18 measured (0.94).
    assert "| `tw` | tensorwise | 100.0 | 40.0 (40.0%) | 1.250x | 1.180x | 0.94 |" in text
    # rowwise 1.25x -> saves 8 -> 100/92 = 1.087x expected, 1.0 measured: 0.92 of it... not short.
    assert "| `rw` | rowwise | 100.0 | 40.0 (40.0%) | 1.087x | 1.000x | 0.92 |" in text
    assert "Where the time went" not in text
    rows[1]["speedup"] = 1.05  # now tensorwise is short (0.84): both profiles by category
    (tmp_path / "e2e.json").write_text(json.dumps({"rows": rows}))
    fx.main(["--layer-bench", str(tmp_path / "b.json"), "--e2e", str(tmp_path / "e2e.json"), "--profiles",
             str(profiles), "--baseline", "bf16", "--recipe", "tw=tensorwise", "--out-md", str(out)])
    text = out.read_text()
    assert "| 1.050x | 0.84 **short** |" in text
    assert "| category | `bf16` ms/step | `tw` ms/step |" in text
    assert "| casts and amax | 0.00 | 15.00 |" in text and "| FP8 GEMMs | 0.00 | 32.00 |" in text
    assert "| head and loss | 10.00 | 0.00 |" in text
