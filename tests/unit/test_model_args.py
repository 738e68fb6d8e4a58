"""Llama3ModelArgs validation, flavor table (published sizes on meta) and the model-spec registry."""
import pytest
import torch

from models import MODEL_SPECS, build_model_args, get_model_spec
from models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, RopeScaling, Transformer


@pytest.mark.parametrize("flavor,hidden", [("debug", 768), ("1B", 8192), ("3B", 8192), ("8B", 14336),
                                           ("70B", 28672), ("405B", 53248)])
def test_ffn_hidden_dim_matches_published_intermediate_size(flavor, hidden):
    assert LLAMA3_FLAVORS[flavor].ffn_hidden_dim == hidden


def _meta_model(flavor: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(LLAMA3_FLAVORS[flavor])


# Exact counts follow from the shapes (2 x these = the bf16 byte totals of the published safetensors
# indexes for 1B, 3B, 8B and 70B); the rounded figures are the published model-card sizes.
@pytest.mark.parametrize("flavor,exact,published", [
    ("1B", 1_235_814_400, 1.24e9),
    ("3B", 3_212_749_824, 3.21e9),
    ("8B", 8_030_261_248, 8.03e9),
    ("70B", 70_553_706_496, 70.55e9),
    ("405B", 405_853_388_800, 405.8e9),
])
def test_published_flavor_param_counts(flavor, exact, published):
    model = _meta_model(flavor)
    assert model.num_params() == exact
    assert abs(exact - published) / published < 0.005  # the published figures are rounded to 3-4 digits


def test_debug_flavor_is_small_and_untied():
    args = LLAMA3_FLAVORS["debug"]
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size) == (256, 6, 8, 4, 2048)
    assert args.rope_scaling is None and not args.tie_word_embeddings
    assert _meta_model("debug").num_params() == 5_770_496


def test_published_flavors_rope_and_tying():
    for name in ("1B", "3B"):
        a = LLAMA3_FLAVORS[name]
        assert a.tie_word_embeddings and a.rope_scaling.factor == 32.0
    for name in ("8B", "70B", "405B"):
        a = LLAMA3_FLAVORS[name]
        assert not a.tie_word_embeddings
        assert a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
        assert (a.vocab_size, a.rope_theta, a.norm_eps, a.max_seq_len, a.n_kv_heads) == (128256, 500000.0, 1e-5, 131072, 8)


def test_tied_model_counts_shared_matrix_once():
    args = Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=100, multiple_of=32, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() - model.num_params(exclude_embedding=True) == 100 * 64


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=100, n_heads=3), "dim=100 must be divisible by n_heads=3"),
    (dict(dim=64, n_heads=4, n_kv_heads=3), "n_heads=4 must be a multiple of n_kv_heads=3"),
    (dict(dim=36, n_heads=4), "head_dim = dim / n_heads = 9 must be even"),
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
    (dict(norm_eps=0.0), "norm_eps=0.0 must be positive"),
])
def test_args_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Llama3ModelArgs(**kwargs)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_n_kv_heads_defaults_to_n_heads():
    assert Llama3ModelArgs(dim=64, n_heads=4).n_kv_heads == 4


def test_get_model_spec_and_unknown_name():
    spec = get_model_spec("llama3")
    assert spec is MODEL_SPECS["llama3"] and spec.model_cls is Transformer and spec.flavors is LLAMA3_FLAVORS
    valid = r"valid: deepseek_v3, llama3, qwen3_moe\."
    with pytest.raises(ValueError, match=rf"unknown model.name 'llama'; {valid} Did you mean 'llama3'\?"):
        get_model_spec("llama")


def test_build_model_args_overrides_and_leaves_flavor_table_alone():
    spec = get_model_spec("llama3")
    args = build_model_args(spec, "8B", n_layers=2, vocab_size=4096, max_seq_len=1024)
    assert (args.n_layers, args.vocab_size, args.max_seq_len, args.dim) == (2, 4096, 1024, 4096)
    assert LLAMA3_FLAVORS["8B"].n_layers == 32 and args is not LLAMA3_FLAVORS["8B"]
    assert build_model_args(spec, "debug") == LLAMA3_FLAVORS["debug"]


def test_build_model_args_errors():
    spec = get_model_spec("llama3")
    with pytest.raises(ValueError, match=r"unknown model.flavor for llama3 '8b'; valid: debug, 1B, 3B, 8B, 70B, 405B\. "
                                         r"Did you mean '8B'"):
        build_model_args(spec, "8b")
    with pytest.raises(ValueError, match=r"flavor 'debug' with overrides \{'n_layers': 0\}: .*n_layers=0"):
        build_model_args(spec, "debug", n_layers=0)
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the tokenizer's vocabulary"):
        build_model_args(spec, "debug", vocab_size=100, min_vocab_size=2000)


def test_min_vocab_size_only_grows():
    spec = get_model_spec("llama3")
    assert build_model_args(spec, "debug", min_vocab_size=3000).vocab_size == 3000
    assert build_model_args(spec, "debug", min_vocab_size=1000).vocab_size == 2048
