"""Small Hugging Face tokenizers built on the spot with the ``tokenizers`` library (no download)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"


def training_texts() -> list[str]:
    """The project's own sources: a few hundred kB of real text, enough for a few thousand merges."""
    return [p.read_text(encoding="utf-8") for p in sorted((ROOT / "torchtitan_lite").rglob("*.py"))]


def llama3_style_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Llama 3's special tokens and, like Llama 3's tokenizer.json, a post-processor
    that prepends BOS (which the project's encoding must not apply a second time)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_texts(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer


def write_model_folder(folder: Path, tokenizer: Tokenizer, *, config: dict | None = None,
                       config_file: str = "tokenizer_config.json") -> Path:
    """A hub-style model folder: tokenizer.json plus the file that names the special tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config is None:
        config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / config_file).write_text(json.dumps(config))
    return folder
