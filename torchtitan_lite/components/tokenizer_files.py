"""Where ``tokenizer.path`` points: a SentencePiece ``.model``, a Hugging Face ``tokenizer.json``, or a folder.

A folder is read like a Hugging Face model folder (e.g. a downloaded ``Llama-3.1-8B``): its
``tokenizer.json`` when it has one, else its SentencePiece ``tokenizer.model``. A ``tokenizer.json`` does
not say which of its tokens begin and end a document; the folder's ``tokenizer_config.json`` (or, when
that names none, ``special_tokens_map.json``) does, as ``bos_token`` / ``eos_token`` / ``pad_token``.
A SentencePiece model carries its own BOS/EOS/pad ids.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
SPECIAL_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?\n")


class TokenizerError(ValueError):
    """A tokenizer file or folder is unusable; the message names the file and the fix."""


class TokenizerNotFoundError(TokenizerError, FileNotFoundError):
    """``tokenizer.path`` names nothing, or a folder without a tokenizer."""


@dataclass(frozen=True)
class TokenizerSource:
    kind: Literal["sentencepiece", "hf"]
    file: Path
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token / eos_token / pad_token / unk_token -> token text, for a tokenizer.json."""
    special_tokens_from: Path | None = None
    """The file those names were read from (None: no such file next to the tokenizer)."""


def locate_tokenizer(path: str, *, missing_hint: str) -> TokenizerSource:
    """The tokenizer file ``path`` names and its special tokens; ``missing_hint`` says how to get one."""
    location = Path(path).expanduser()
    if location.is_dir():
        if (location / HF_TOKENIZER_FILE).is_file():
            return _hf_source(location / HF_TOKENIZER_FILE)
        if (location / SENTENCEPIECE_FILE).is_file():
            return TokenizerSource("sentencepiece", location / SENTENCEPIECE_FILE)
        held = sorted(p.name for p in location.iterdir())[:10]
        raise TokenizerNotFoundError(
            f"tokenizer.path={path!r} is a folder without {HF_TOKENIZER_FILE} or {SENTENCEPIECE_FILE} (it holds "
            f"{held or 'nothing'}); {missing_hint}")
    if location.is_file():
        if location.name in SPECIAL_TOKEN_FILES:
            raise TokenizerError(f"tokenizer.path={path!r} names the special-token file, not the tokenizer; point "
                                 f"tokenizer.path at its folder {str(location.parent)!r}")
        if location.suffix == ".json":
            return _hf_source(location)
        _reject_tiktoken(location, path)
        return TokenizerSource("sentencepiece", location)
    raise TokenizerNotFoundError(f"tokenizer.path={path!r} does not exist ({location.absolute()}); {missing_hint}")


def _hf_source(file: Path) -> TokenizerSource:
    for name in SPECIAL_TOKEN_FILES:
        candidate = file.parent / name
        if candidate.is_file():
            tokens = _special_tokens(candidate)
            if tokens.get("bos_token") or tokens.get("eos_token"):
                return TokenizerSource("hf", file, tokens, candidate)
    return TokenizerSource("hf", file)


def _special_tokens(file: Path) -> dict[str, str]:
    """bos/eos/pad/unk token texts of a tokenizer_config.json / special_tokens_map.json. Each is a string,
    an AddedToken dict ({"content": ...}) or null."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{file} is not readable JSON ({error}); re-download the tokenizer folder") from error
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} holds {type(data).__name__}, not a JSON object; re-download the tokenizer folder")
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = data.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            tokens[key] = value
    return tokens


def _reject_tiktoken(file: Path, path: str) -> None:
    """Llama 3's original/tokenizer.model is a tiktoken rank file, not SentencePiece: say so instead of
    letting SentencePiece fail with a parse error."""
    try:
        with open(file, "rb") as f:
            head = f.readline(256)
    except OSError:
        return
    if _TIKTOKEN_LINE.match(head):
        raise TokenizerError(
            f"tokenizer.path={path!r} is a tiktoken rank file (like Llama 3's original/tokenizer.model), which is "
            f"not supported; point tokenizer.path at the model folder that holds {HF_TOKENIZER_FILE} "
            f"(scripts/download_hf_assets.py fetches it)")
