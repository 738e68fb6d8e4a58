"""A run's tokenizer in a Hugging Face folder, in the form ``AutoTokenizer.from_pretrained`` loads.

* SentencePiece ``.model`` (this project's default): rebuilt as a ``tokenizer.json`` with the
  ``tokenizers`` library (same BPE vocabulary and merges, byte fallback, whitespace as ``▁``), the
  ``.model`` copied beside it as ``tokenizer.model``.
* A ``tokenizer.json`` file, or a folder holding one: copied, with its post-processor replaced by one
  that prepends the run's BOS and nothing else (a user's file may add no BOS, another BOS, or an EOS).

Either way ``tokenizer_config.json`` and ``special_tokens_map.json`` name BOS/EOS, and the fast
tokenizer prepends BOS exactly like the run's ``encode(text, bos=True, eos=False)`` (training and
generate.py), so ``AutoTokenizer`` gives a prompt the same ids.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SP_MODEL = "tokenizer.model"
SENTENCEPIECE_NORMAL = 1
"""``ModelProto.SentencePiece.Type.NORMAL``: pieces learned by BPE (not control, byte or user-defined)."""


def tokenizer_source(path: str | os.PathLike) -> tuple[str, Path]:
    """('sentencepiece' | 'json', file) for a SentencePiece model, a tokenizer.json or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        for name, kind in ((TOKENIZER_JSON, "json"), (SP_MODEL, "sentencepiece")):
            if (path / name).is_file():
                return kind, path / name
        raise FileNotFoundError(f"tokenizer folder {path} holds neither {TOKENIZER_JSON} nor {SP_MODEL}")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    return ("json" if path.suffix == ".json" else "sentencepiece"), path


def export_tokenizer(source: str | os.PathLike, out_dir: str, *, bos_id: int, eos_id: int, model_max_length: int) -> None:
    """Write the tokenizer files of ``source`` into ``out_dir`` (which exists)."""
    kind, file = tokenizer_source(source)
    out = Path(out_dir)
    if kind == "sentencepiece":
        tokenizer = sentencepiece_to_fast(file, bos_id=bos_id)
        tokenizer.save(str(out / TOKENIZER_JSON))
        shutil.copyfile(file, out / SP_MODEL)
    else:
        tokenizer = _load_fast(file)
        tokenizer.post_processor = _bos_only(tokenizer, bos_id)
        tokenizer.save(str(out / TOKENIZER_JSON))
    bos, eos = tokenizer.id_to_token(bos_id), tokenizer.id_to_token(eos_id)
    if bos is None or eos is None:
        raise ValueError(f"{file} has no token for bos_id={bos_id} or eos_id={eos_id}; the exported tokenizer "
                         f"could not name its BOS/EOS")
    specials = {"bos_token": bos, "eos_token": eos}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", specials)


def sentencepiece_to_fast(model_file: str | os.PathLike, *, bos_id: int) -> Any:
    """A ``tokenizers.Tokenizer`` that encodes and decodes like the SentencePiece BPE ``model_file``.

    Merges are recovered from the vocabulary: each learned piece is the merge of every split of it into
    two known pieces, ranked by the piece's id (SentencePiece BPE ids follow merge order).
    """
    tokenizers = _tokenizers()
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf module
    proto.ParseFromString(Path(model_file).read_bytes())
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE:
        raise ValueError(f"{model_file} is not a BPE SentencePiece model; only BPE models convert to tokenizer.json")
    if proto.normalizer_spec.add_dummy_prefix or proto.normalizer_spec.name not in ("identity", ""):
        raise ValueError(f"{model_file} normalises text (add_dummy_prefix or a normalisation rule); train it with "
                         f"scripts/train_tokenizer.py, whose models convert exactly")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked = []
    for i, p in enumerate(proto.pieces):
        if p.type != SENTENCEPIECE_NORMAL or len(p.piece) < 2:
            continue
        splits = [(p.piece[:k], p.piece[k:]) for k in range(1, len(p.piece))]
        ranked += [(i, vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab]
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    unk = proto.pieces[proto.trainer_spec.unk_id].piece
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                                                     fuse_unk=True))
    tok.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.Replace("\u2581", " "),
                                                tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()])
    control = [p.piece for p in proto.pieces if p.type in (2, 3)]  # UNKNOWN, CONTROL
    user_defined = [p.piece for p in proto.pieces if p.type == 4]
    tok.add_special_tokens([tokenizers.AddedToken(piece, special=True, normalized=False) for piece in control])
    tok.add_tokens([tokenizers.AddedToken(piece, special=False, normalized=False) for piece in user_defined])
    tok.post_processor = _bos_only(tok, bos_id)
    return tok


def _bos_only(tokenizer: Any, bos_id: int) -> Any:
    """A post-processor that prepends ``bos_id``, as the project's ``encode(bos=True, eos=False)`` does on
    top of the plain encoding. A byte-level offsets step of the file's own post-processor is kept (it changes
    offsets, not ids); anything that adds tokens is dropped."""
    processors = _tokenizers().processors
    bos = tokenizer.id_to_token(bos_id)
    if bos is None:
        raise ValueError(f"the tokenizer has no token for bos_id={bos_id}; the exported tokenizer could not prepend it")
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    spec = json.loads(tokenizer.to_str()).get("post_processor") or {}
    steps = spec.get("processors", []) if spec.get("type") == "Sequence" else [spec]
    byte_level = [processors.ByteLevel(**{key: step[key] for key in ("add_prefix_space", "trim_offsets", "use_regex")
                                          if key in step})
                  for step in steps if step.get("type") == "ByteLevel"]
    return processors.Sequence([*byte_level, template]) if byte_level else template


def _load_fast(path: Path) -> Any:
    return _tokenizers().Tokenizer.from_file(str(path))


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("exporting a tokenizer needs the 'tokenizers' package: pip install -e .[hf]") from None
    return tokenizers


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
