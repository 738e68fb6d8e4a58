"""Transformer behaviour: shapes, causality, GQA, tensor-parallel head slices, RMSNorm numerics, init, FLOPs."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from models.common.attention.rope import rope_cache
from models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, Transformer
from models.llama3.attention import Attention
from models.llama3.model import RMSNorm

TINY = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32,
                       rope_theta=10000.0, max_seq_len=64)


def _tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(Llama3ModelArgs(**{**TINY.__dict__, **overrides}))


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_forward_shapes_on_meta(flavor):
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
        logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, args.vocab_size)
    assert sorted(model.layers.keys(), key=int) == [str(i) for i in range(args.n_layers)]


def test_module_names_follow_the_contract():
    names = {n for n, _ in _tiny().named_parameters()}
    per_layer = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "attention_norm",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "ffn_norm"]
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{m}.weight" for i in range(2) for m in per_layer}
    assert names == expected  # no biases, nothing else


def test_causality_is_exact():
    model = _tiny()
    tokens = torch.randint(0, 100, (2, 48))
    changed = tokens.clone()
    changed[:, 20:] = torch.randint(0, 100, (2, 28))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])  # fp32: future tokens never enter earlier rows
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def _reference_attention(attn: Attention, x: torch.Tensor, cache: torch.Tensor, n_heads: int, n_kv: int):
    """Naive causal attention where query head h reads key/value head h // (n_heads / n_kv)."""
    from models.common.attention.rope import apply_rotary_emb
    b, s, _ = x.shape
    hd = attn.head_dim
    q = apply_rotary_emb(attn.wq(x).view(b, s, n_heads, hd), cache)
    k = apply_rotary_emb(attn.wk(x).view(b, s, n_kv, hd), cache)
    v = attn.wv(x).view(b, s, n_kv, hd)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) / hd ** 0.5
        heads.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, :, g])
    return attn.wo(torch.stack(heads, dim=2).reshape(b, s, -1))


def test_gqa_matches_explicit_per_group_attention():
    args = Llama3ModelArgs(dim=64, n_heads=8, n_kv_heads=2, rope_theta=10000.0, max_seq_len=32)
    torch.manual_seed(0)
    attn = Attention(args)
    attn.init_weights(0.02)
    x = torch.randn(2, 32, 64)
    cache = rope_cache(args.head_dim, 32, args.rope_theta, None)
    with torch.no_grad():
        out = attn(x, cache)
        ref = _reference_attention(attn, x, cache, 8, 2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # fp32, outputs ~1e-2: only summation order differs


def test_attention_infers_local_heads_like_a_tensor_parallel_rank():
    # Split heads in two like TP=2 (wq/wk/wv by output rows, wo by input columns): the two partial outputs
    # must sum to the full output, which only works if each half reads its head count from the tensors.
    args = Llama3ModelArgs(dim=64, n_heads=4, n_kv_heads=2, rope_theta=10000.0, max_seq_len=16)
    torch.manual_seed(0)
    full = Attention(args)
    x = torch.randn(1, 16, 64)
    cache = rope_cache(args.head_dim, 16, args.rope_theta, None)
    halves = []
    for r in range(2):
        local = Attention(args)
        with torch.no_grad():
            for name in ("wq", "wk", "wv"):
                w = getattr(full, name).weight
                rows = w.shape[0] // 2
                getattr(local, name).weight = torch.nn.Parameter(w[r * rows:(r + 1) * rows].clone())
            cols = full.wo.weight.shape[1] // 2
            local.wo.weight = torch.nn.Parameter(full.wo.weight[:, r * cols:(r + 1) * cols].clone())
            halves.append(local(x, cache))
    with torch.no_grad():
        torch.testing.assert_close(halves[0] + halves[1], full(x, cache), atol=1e-6, rtol=0)  # fp32 sum order


def test_rmsnorm_is_fp32_with_one_rounding_in_every_precision_path():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(4, 8, 64) * 3).bfloat16()
    w16 = norm.weight.bfloat16().float()
    xf = x.float()
    reference = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w16).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mixed-dtype fallback of torch.rms_norm warns
        out = norm(x)  # fp32 weight, bf16 activations: the autocast path
    assert out.dtype == torch.bfloat16 and torch.equal(out, reference)
    assert torch.equal(norm.bfloat16()(x), reference)  # bf16 weight: the FSDP mixed-precision path


def test_meta_build_then_to_empty_and_init_weights():
    args = Llama3ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64,
                           rope_theta=10000.0, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    # Targets are the pre-truncation stds; a 3-sigma cut shrinks them by 1.3%, well inside 10%.
    def close(w, std):
        return abs(w.std().item() - std) / std < 0.10
    assert close(model.layers["0"].attention.wq.weight, 0.02)
    assert close(model.layers["1"].feed_forward.w1.weight, 0.02)
    assert close(model.layers["0"].attention.wo.weight, 0.02 / 2 ** 0.5)   # depth_init: layer 0 -> sqrt(2 * 1)
    assert close(model.layers["1"].feed_forward.w2.weight, 0.02 / 4 ** 0.5)  # layer 1 -> sqrt(2 * 2)
    assert close(model.output.weight, 128 ** -0.5)
    assert model.output.weight.abs().max() <= 3 * 128 ** -0.5
    assert close(model.tok_embeddings.weight, 1.0)
    assert torch.equal(model.norm.weight, torch.ones(128))
    assert torch.equal(model.layers["1"].ffn_norm.weight, torch.ones(128))
    assert torch.equal(model.rope.cache, rope_cache(32, 64, 10000.0, None))
    logits = model(torch.randint(0, 512, (2, 32)))
    assert torch.isfinite(logits).all()


def test_depth_init_false_scales_by_total_depth():
    model = _tiny(depth_init=False, n_layers=4, dim=128)
    for layer in model.layers.values():
        assert layer.out_proj_std == pytest.approx(0.02 / 8 ** 0.5)
    assert abs(model.layers["0"].attention.wo.weight.std().item() - 0.02 / 8 ** 0.5) < 0.1 * 0.02 / 8 ** 0.5


def test_tied_embeddings_survive_meta_init_and_share_gradients():
    args = Llama3ModelArgs(**{**TINY.__dict__, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert abs(model.output.weight.std().item() - 64 ** -0.5) < 0.1 * 64 ** -0.5  # output-projection std
    assert len(list(model.parameters())) == len(model.state_dict()) - 1  # state_dict lists both names


def test_rejects_sequences_longer_than_the_table():
    model = _tiny(max_seq_len=16)
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_num_params_and_flops_per_token_by_hand():
    # head_dim 16, ffn int(2 * 256 / 3) = 170 -> rounded up to 192.
    # per layer: wq 64*64 + wk/wv 2*(32*64) + wo 64*64 = 12288; ffn 3*64*192 = 36864; norms 128 -> 49280
    # non-embedding N = 2*49280 + 64 (final norm) + 100*64 (output) = 105024
    model = _tiny()
    assert model.num_params(exclude_embedding=True) == 105_024
    assert model.num_params() == 105_024 + 100 * 64
    assert model.flops_per_token(32) == 6 * 105_024 + 12 * 2 * 4 * 16 * 32 == 679_296
    # Tied: the shared matrix is the output matmul; the embedding lookup costs no FLOPs either way.
    tied = _tiny(tie_word_embeddings=True)
    assert tied.num_params() == 105_024 and tied.num_params(exclude_embedding=True) == 105_024 - 6400
    assert tied.flops_per_token(32) == 679_296


def test_backward_reaches_every_parameter():
    model = _tiny()
    logits = model(torch.randint(0, 100, (2, 16)))
    F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 100, (32,))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_cpu_reduced_precision_attention_runs_in_float32_and_returns_the_input_dtype():
    # bf16 inputs attended in float32 (CPU autocast on, as in a single-process bf16 run): the result equals
    # float32 attention of the same bf16-rounded inputs, rounded once to bf16.
    from models.common.attention.grouped_query import causal_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, heads, 24, 16).bfloat16() for heads in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(q, k, v, enable_gqa=True)
    reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                                 enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.bfloat16())
