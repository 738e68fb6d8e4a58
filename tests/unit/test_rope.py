"""Rotary embeddings: Llama 3.1 frequency scaling, Meta's complex formulation, relative positions, cast safety."""
import math

import pytest
import torch

from models.common.attention.rope import RotaryEmbedding, apply_rotary_emb, rope_cache, rope_frequencies
from models.llama3 import Llama3ModelArgs, RopeScaling, Transformer

LLAMA31 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _reference_llama31_scaling(freqs: torch.Tensor) -> torch.Tensor:
    """Meta's Llama 3.1 `apply_scaling`, one frequency at a time."""
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype)


def test_llama31_scaling_matches_reference_loop_exactly():
    base = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(128, 500000.0, LLAMA31)
    ref = _reference_llama31_scaling(base)
    assert scaled.dtype == torch.float32
    assert torch.equal(scaled, ref)  # same float32 operations in the same order
    # All three bands occur for the 8B head size: kept, interpolated, divided by the factor.
    assert (scaled == base).any() and (scaled == base / 8).any()
    assert ((scaled != base) & (scaled != base / 8)).any()


def test_rope_matches_meta_complex_formulation():
    # Meta's reference: view channel pairs as complex numbers and multiply by exp(i * pos * freq).
    torch.manual_seed(0)
    head_dim, seqlen = 16, 40
    x = torch.randn(2, seqlen, 3, head_dim)
    cache = rope_cache(head_dim, 64, 10000.0, None)
    freqs = torch.outer(torch.arange(seqlen).float(), rope_frequencies(head_dim, 10000.0, None))
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    x_c = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    ref = torch.view_as_real(x_c * freqs_cis[None, :, None, :]).flatten(3)
    torch.testing.assert_close(apply_rotary_emb(x, cache), ref, atol=1e-6, rtol=0)  # fp32, |x| ~ 1


def test_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    head_dim, seqlen = 32, 48
    q = torch.nn.functional.normalize(torch.randn(head_dim), dim=0).expand(1, seqlen, 1, head_dim)
    k = torch.nn.functional.normalize(torch.randn(head_dim), dim=0).expand(1, seqlen, 1, head_dim)
    cache = rope_cache(head_dim, seqlen, 10000.0, LLAMA31)
    rq, rk = apply_rotary_emb(q, cache)[0, :, 0], apply_rotary_emb(k, cache)[0, :, 0]
    scores = rq @ rk.T  # scores[m, n] should be a function of m - n
    for offset in (0, 3, 17):
        diag = torch.diagonal(scores, offset=-offset)
        # unit vectors, angles < 48 rad: float32 angle rounding keeps the spread far below 1e-5
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), atol=1e-5, rtol=0)
    assert not torch.allclose(scores[5, 0], scores[5, 5])  # and it does depend on the offset


def test_rope_computes_in_fp32_and_returns_activation_dtype():
    torch.manual_seed(0)
    cache = rope_cache(16, 2048, 500000.0, None)
    x = torch.randn(1, 2048, 2, 16).bfloat16()
    out = apply_rotary_emb(x, cache)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rotary_emb(x.float(), cache).bfloat16())  # one rounding at the end


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()])
def test_table_survives_dtype_casts(cast):
    rope = RotaryEmbedding(64, 4096, 500000.0, LLAMA31)
    reference = rope_cache(64, 4096, 500000.0, LLAMA31)
    cast(rope)
    assert rope.cache.dtype == torch.complex64
    assert torch.equal(rope.cache, reference)


def test_model_cast_to_bf16_keeps_fp32_table_and_runs():
    args = Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args).to(torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(model.rope.cache, rope_cache(16, 64, args.rope_theta, None))
    assert "rope.cache" not in model.state_dict()  # derived state is never checkpointed
    logits = model(torch.randint(0, 64, (2, 32)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_to_empty_then_forward_has_valid_table():
    # A meta-built model moved with to_empty (e.g. before loading a checkpoint) gets a real table at once.
    with torch.device("meta"):
        rope = RotaryEmbedding(16, 32, 10000.0, None)
    rope.to_empty(device="cpu")
    assert torch.equal(rope.cache, rope_cache(16, 32, 10000.0, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_rotation_equals_the_real_form_eager_and_compiled(dtype):
    # (a cos - b sin, a sin + b cos) written out in float32, against the complex multiply eagerly and under
    # torch.compile (aot_eager: the same aten ops after tracing). The same float32 products and sums: bitwise
    # on the AVX2 / AVX-512 CPUs measured; 1e-6 (|x| ~ 1, ulp ~ 1e-7) allows a kernel contracting multiply-adds.
    torch.manual_seed(0)
    cache = rope_cache(32, 128, 500000.0, None)
    x = torch.randn(2, 100, 3, 32).to(dtype).requires_grad_()
    grad = torch.randn(2, 100, 3, 32).to(dtype)
    cos, sin = cache.real[:100].view(1, 100, 1, 16), cache.imag[:100].view(1, 100, 1, 16)
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    real_form = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)
    (real_grad,) = torch.autograd.grad(real_form, x, grad)
    # bf16: the same float32 value rounded once; a 1e-6 float32 difference could move it by one bf16 ulp (2**-8).
    atol, rtol = (1e-6, 0.0) if dtype == torch.float32 else (0.0, 2**-8)
    for rotate in (apply_rotary_emb, torch.compile(apply_rotary_emb, backend="aot_eager", fullgraph=True)):
        out = rotate(x, cache)
        (out_grad,) = torch.autograd.grad(out, x, grad)
        torch.testing.assert_close(out, real_form, atol=atol, rtol=rtol)
        torch.testing.assert_close(out_grad, real_grad, atol=atol, rtol=rtol)
