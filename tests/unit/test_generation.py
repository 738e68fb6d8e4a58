"""Generation: KV-cache decoding equals full recomputation, sampling options, loading a run's checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

import config_registry
from models import build_model_args, get_model_spec
from torchtitan_lite.components.checkpoint import CheckpointManager, ModelWrapper
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.components.generation import GenerationModel, generate, load_from_dcp
from torchtitan_lite.components.sampling import SamplingConfig, sample_next
from torchtitan_lite.config import apply_overrides, config_to_toml
from torchtitan_lite.config.overrides import Override
from torchtitan_lite.tools import generate as generate_tool

SPEC = get_model_spec("llama3")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Tok:
    eos_id = -1  # never stops early: every test decodes the full length


def loaded(seed: int = 0, n_layers: int = 2, scale: float = 1.0) -> GenerationModel:
    torch.manual_seed(seed)
    args = build_model_args(SPEC, "debug", n_layers=n_layers, vocab_size=512)
    model = SPEC.model_cls(args).eval()
    with torch.no_grad():  # sharper logits than the init's, so sampling choices are not all ties
        model.output.weight.mul_(scale)
    return GenerationModel(model, _Tok(), SPEC.kv_cache_cls)


PROMPT = [1, 17, 300, 42, 5, 99, 7]


def test_kv_cache_greedy_equals_recomputing_the_prefix():
    m = loaded()
    cached = generate(m, PROMPT, max_new_tokens=40, use_cache=True)
    full = generate(m, PROMPT, max_new_tokens=40, use_cache=False)
    assert cached == full
    assert len(set(cached)) > 1  # not a degenerate repetition of one token


def test_kv_cache_logits_match_the_training_forward():
    # Same weights and ops, different shapes: float32 sums may reorder, hence 1e-5.
    m = loaded()
    tokens = torch.tensor([PROMPT + [3, 4, 5]])
    full = m.model(tokens)
    cache = SPEC.kv_cache_cls(m.model, batch_size=1, max_len=tokens.shape[1])
    prefix = cache(tokens[:, :7], 0)
    steps = [cache(tokens[:, i:i + 1], i) for i in range(7, tokens.shape[1])]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    m = loaded(scale=20.0)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    a = generate(m, PROMPT, max_new_tokens=30, sampling=sampling, seed=3)
    assert a == generate(m, PROMPT, max_new_tokens=30, sampling=sampling, seed=3)
    assert a != generate(m, PROMPT, max_new_tokens=30, sampling=sampling, seed=4)


def test_top_k_1_is_greedy():
    m = loaded(scale=20.0)
    greedy = generate(m, PROMPT, max_new_tokens=20)
    assert generate(m, PROMPT, max_new_tokens=20, sampling=SamplingConfig(temperature=1.5, top_k=1), seed=0) == greedy


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]])
    gen = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, SamplingConfig(temperature=1.0, top_k=2), gen)) for _ in range(200)}
    assert picks == {0, 1}
    # softmax of these logits: 0.71, 0.26, 0.013, ...; p=0.9 keeps the first two, p=0.5 only the first.
    picks = {int(sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.9), gen)) for _ in range(200)}
    assert picks == {0, 1}
    assert {int(sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.5), gen)) for _ in range(50)} == {0}


def test_bad_sampling_settings_are_named():
    with pytest.raises(ValueError, match=r"top_p=1\.5 must be in \(0, 1\]"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1 must be >= 0"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=2048"):
        generate(loaded(n_layers=1), PROMPT, max_new_tokens=2048)


def save_run(dump, n_layers: int = 1, config: str = "llama3_debug", convert=None, config_in_checkpoint: bool = True) -> str:
    """A run folder as train.py leaves it: config.toml (with an n_layers override) + a checkpoint of a model
    that ``convert`` (e.g. float8 training) may have changed, holding that config too unless
    ``config_in_checkpoint`` is False (as checkpoints written before they carried it)."""
    cfg = apply_overrides(config_registry.get(config),
                          [Override("model.n_layers", n_layers, "test"), Override("job.dump_folder", str(dump), "test")])
    os.makedirs(dump, exist_ok=True)
    (dump / "config.toml").write_text(config_to_toml(cfg))
    torch.manual_seed(0)
    args = build_model_args(SPEC, "debug", n_layers=n_layers, min_vocab_size=cfg.tokenizer.build().vocab_size)
    model = SPEC.model_cls(args)
    if convert is not None:
        model = convert(model)
    ckpt = CheckpointManager.Config(enable=True).build(dump_folder=str(dump), states={"model": ModelWrapper(model)},
                                                       model_args=args, model_spec=SPEC,
                                                       run_config=config_to_toml(cfg) if config_in_checkpoint else None)
    ckpt.save(5, last_step=True)
    ckpt.close()
    return str(dump / "checkpoint" / "step-5")


def test_generate_script_reads_the_run_config(tmp_path, capsys):
    ckpt = save_run(tmp_path / "run", n_layers=1)
    cfg = config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY)
    assert cfg.model.n_layers == 1
    loaded_model = load_from_dcp(ckpt, cfg)
    text = generate_tool.main(["--checkpoint", ckpt, "--prompt", "def main(", "--max-new-tokens", "8"],
                              registry=config_registry.DEFAULT_REGISTRY)
    assert capsys.readouterr().out == text + "\n"
    ids = loaded_model.tokenizer.encode("def main(", bos=True, eos=False)
    expected = generate(loaded_model, ids, max_new_tokens=8)
    assert text == "def main(" + loaded_model.tokenizer.decode(expected)


def test_an_fp8_trained_checkpoint_loads_into_a_plain_model(tmp_path):
    float8 = pytest.importorskip("torchao.float8")
    kept = {}

    def to_float8(model):
        converted = float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "output")
        assert type(converted.layers["0"].attention.wq).__name__ == "Float8Linear"  # the case under test
        kept["state"] = {k: v.detach().clone() for k, v in converted.state_dict().items()}
        return converted

    ckpt = save_run(tmp_path / "run", n_layers=1, config="llama3_debug_fp8", convert=to_float8)
    cfg = config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY)
    assert cfg.model_converters.converters  # the run trained with float8 ...
    plain = load_from_dcp(ckpt, cfg)
    assert type(plain.model.layers["0"].attention.wq) is torch.nn.Linear  # ... generation uses plain Linears
    for key, value in plain.model.state_dict().items():
        assert torch.equal(value, kept["state"][key].float()), key
    assert len(generate(plain, PROMPT, max_new_tokens=4)) == 4
