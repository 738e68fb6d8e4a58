"""Export of a whole run: weights, tokenizer and generation config load in transformers and generate what we do."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from _transformers import import_transformers
from test_generation import save_run

import config_registry
from torchtitan_lite.components.checkpoint.hf_tokenizer import export_tokenizer, sentencepiece_to_fast
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.components.generation import generate, load_from_dcp, load_from_hf
from torchtitan_lite.components.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["def main(", "  x = 1\n\tif y:\n        return None  # \u00e9\u4e2d\U0001F600", " leading space",
         "a  b   c\n\n\n", "import os\nimport sys\n\n\nclass A(object):\n    pass\n", "x = 12345.678e-9"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sentencepiece_to_tokenizer_json_encodes_and_decodes_alike():
    pytest.importorskip("tokenizers")
    ours = Tokenizer.Config().build()
    fast = sentencepiece_to_fast(ours.path, bos_id=ours.bos_id)
    for text in TEXTS:
        assert fast.encode(text).ids == ours.encode(text, bos=True, eos=False), text
        assert fast.decode(ours.encode(text, bos=False, eos=False)) == text


def test_a_tokenizer_json_source_is_exported_with_bos_and_eos(tmp_path):
    pytest.importorskip("tokenizers")
    ours = Tokenizer.Config().build()
    sentencepiece_to_fast(ours.path, bos_id=ours.bos_id).save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    out.mkdir()
    export_tokenizer(tmp_path, str(out), bos_id=1, eos_id=2, model_max_length=128)  # a folder holding tokenizer.json
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"bos_token": "<s>", "eos_token": "</s>"}
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)


def _sentencepiece_source(folder):
    return Tokenizer.Config().build().path  # the project's default .model


def _json_source(post_processor: str):
    def write(folder):
        from _hf_tokenizer import BOS, EOS, llama3_style_tokenizer, write_model_folder
        from tokenizers import processors

        tokenizer = llama3_style_tokenizer(vocab_size=600)
        bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
        tokenizer.post_processor = {
            "bos": tokenizer.post_processor,  # Llama 3's own: prepends BOS
            "none": None,  # a plain tokenizer.json: the run still prepends BOS
            "bos_eos": processors.TemplateProcessing(single=f"{BOS} $A {EOS}", special_tokens=[(BOS, bos), (EOS, eos)]),
            "byte_level": processors.ByteLevel(trim_offsets=False),
        }[post_processor]
        return str(write_model_folder(folder, tokenizer))
    return write


@pytest.mark.parametrize("source", [_sentencepiece_source, _json_source("bos"), _json_source("none"),
                                    _json_source("bos_eos"), _json_source("byte_level")],
                         ids=["sentencepiece", "json_bos", "json_plain", "json_bos_eos", "json_byte_level"])
def test_the_exported_tokenizer_encodes_exactly_as_the_run_did(tmp_path, source):
    # AutoTokenizer on the export gives the ids of the run's tokenizer with BOS (training and generate.py).
    transformers = import_transformers()
    path = source(tmp_path / "source")
    ours = Tokenizer.Config(path=path).build()
    out = tmp_path / "out"
    out.mkdir()
    export_tokenizer(path, str(out), bos_id=ours.bos_id, eos_id=ours.eos_id, model_max_length=128)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    expected = [ours.encode(text, bos=True, eos=False) for text in TEXTS]
    assert [theirs(text)["input_ids"] for text in TEXTS] == expected
    assert theirs(TEXTS)["input_ids"] == expected
    assert all(theirs.decode(ids[1:]) == text for ids, text in zip(expected, TEXTS))


def test_convert_to_hf_writes_the_configs_export_dtype_unless_told_otherwise(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    ckpt = save_run(tmp_path / "run", n_layers=1)
    assert config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY).checkpoint.export_dtype == "float32"
    for argv, expected in (([], "F32"), (["--dtype", "bfloat16"], "BF16")):
        out = tmp_path / f"hf{len(argv)}"
        _script("convert_to_hf").main(["--checkpoint", ckpt, "--output", str(out), *argv])
        with safetensors.safe_open(str(out / "model.safetensors"), framework="np") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        assert dtypes == {expected}, argv


def test_run_exports_with_only_the_checkpoint_and_transformers_generates_the_same(tmp_path):
    transformers = import_transformers()
    ckpt = save_run(tmp_path / "run", n_layers=2)  # trained with --model.n_layers 2
    out = tmp_path / "hf"
    _script("convert_to_hf").main(["--checkpoint", ckpt, "--dtype", "float32", "--output", str(out)])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json", "config.toml"} <= set(os.listdir(out))

    model = transformers.LlamaForCausalLM.from_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert model.config.num_hidden_layers == 2
    ours = load_from_dcp(ckpt, config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY))
    prompt = "def main("
    prompt_ids = ours.tokenizer.encode(prompt, bos=True, eos=False)
    assert tokenizer(prompt)["input_ids"] == prompt_ids
    expected = generate(ours, prompt_ids, max_new_tokens=16)

    pipe = transformers.pipeline("text-generation", model=str(out))
    result = pipe(prompt, max_new_tokens=16, do_sample=False, return_tensors=True)
    theirs = [int(t) for t in result[0]["generated_token_ids"]][len(prompt_ids):]
    # The whole greedy continuation, token for token: both stop at EOS or after 16 tokens (16 here), so a
    # weight or RoPE mismatch that only shows a few tokens in cannot pass on the first token alone.
    assert len(expected) >= 8
    assert theirs == expected
    text = pipe(prompt, max_new_tokens=16, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt)

    # The exported folder also serves generation and conversion back without --config.
    from_hf = load_from_hf(str(out), config_for_checkpoint(str(out), registry=config_registry.DEFAULT_REGISTRY))
    assert generate(from_hf, prompt_ids, max_new_tokens=16) == expected
    _script("convert_from_hf").main(["--hf-dir", str(out), "--output", str(tmp_path / "seed")])
    assert (tmp_path / "seed" / ".metadata").is_file()
    torch.testing.assert_close(from_hf.model.output.weight, ours.model.output.weight, atol=0, rtol=0)
