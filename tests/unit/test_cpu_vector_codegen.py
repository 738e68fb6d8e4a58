"""The probe that caps inductor's CPU vector width where the C++ compiler miscompiles its bfloat16 transposes:
it tells a right transpose from a wrong one, acts only on a wrong one, and leaves a user's chosen width alone.
Whether this machine's compiler is affected varies by CPU and compiler, so no test asserts it either way; the
probe's verdicts are checked with kernels whose answer is known on every machine."""
import pytest
import torch._inductor.config as inductor_config

from torchtitan_lite import cpu_vector_codegen as codegen


@pytest.fixture
def fresh_probe():
    """The once-per-process cache cleared and inductor's width restored around the test."""
    codegen.use_correct_cpu_vector_width.cache_clear()
    with inductor_config.patch({"cpp.simdlen": None}):
        yield
    codegen.use_correct_cpu_vector_width.cache_clear()


def _one_transpose_per_kernel_call() -> str:
    """A correct kernel with the probe's signature: the second transpose done by scalar code."""
    scalar = """
    for (int64_t r = 0; r < 64; r++)
        for (int64_t c = 0; c < 64; c++) b_t[c * 64 + r] = b[r * 64 + c];"""
    return codegen.PROBE_SOURCE.replace(codegen._transpose("b", "b_t"), scalar)


def _planted_copy() -> str:
    """A wrong kernel with the probe's signature: copies instead of transposing."""
    return ("#include <torch/csrc/inductor/cpp_prefix.h>\n"
            "extern \"C\" void kernel(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* a_t, "
            "at::BFloat16* b_t) { for (int64_t i = 0; i < 64 * 64; i++) { a_t[i] = a[i]; b_t[i] = b[i]; } }\n")


def test_the_probe_passes_a_correct_kernel_and_fails_a_wrong_one(monkeypatch):
    monkeypatch.setattr(codegen, "PROBE_SOURCE", _one_transpose_per_kernel_call())
    assert codegen.probe_transposes_are_right()
    monkeypatch.setattr(codegen, "PROBE_SOURCE", _planted_copy())
    assert not codegen.probe_transposes_are_right()


def test_a_wrong_probe_caps_the_width_and_says_why(monkeypatch, fresh_probe):
    monkeypatch.setattr(codegen, "probe_transposes_are_right", lambda: False)
    monkeypatch.setattr("torch._inductor.cpu_vec_isa.pick_vec_isa", lambda: _Isa(512))
    note = codegen.use_correct_cpu_vector_width()
    assert inductor_config.cpp.simdlen == 256
    assert "torch._inductor.config.cpp.simdlen=256" in note and "instead of 512" in note and "miscompiles" in note


@pytest.mark.parametrize(("probe_right", "bits", "user_width"), [(True, 512, None), (False, 256, None), (False, 512, 512)],
                         ids=["right_transposes", "256_bit_vectors", "user_chose_a_width"])
def test_nothing_changes_unless_the_probe_fails_on_512_bit_vectors(monkeypatch, fresh_probe, probe_right, bits,
                                                                   user_width):
    monkeypatch.setattr(codegen, "probe_transposes_are_right", lambda: probe_right)
    monkeypatch.setattr("torch._inductor.cpu_vec_isa.pick_vec_isa", lambda: _Isa(bits))
    inductor_config.cpp.simdlen = user_width
    assert codegen.use_correct_cpu_vector_width() is None
    assert inductor_config.cpp.simdlen == user_width


class _Isa:
    def __init__(self, bits: int) -> None:
        self.bits = bits

    def __bool__(self) -> bool:
        return True

    def bit_width(self) -> int:
        return self.bits
