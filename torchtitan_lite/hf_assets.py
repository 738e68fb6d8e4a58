"""Hugging Face hub assets: fetching tokenizers (and weights), checking that a hub dataset is reachable.

The published-size configs read the Llama 3 tokenizer from ``assets/hf/Llama-3.1-8B`` (relative to the
directory the run starts in, the repository root for run_train.sh) and stream a hub corpus. Nothing here
downloads at run time: ``scripts/download_hf_assets.py`` fetches the tokenizer once, and the checks before
a launch only ask the hub whether a dataset exists (metadata, no data), with a short timeout.

``huggingface_hub`` is imported inside the functions, so reading these constants costs nothing.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("torchtitan_lite")

ASSETS_DIR = Path("assets") / "hf"
"""Where scripts/download_hf_assets.py puts a repository by default: assets/hf/<repository name>."""
LLAMA3_TOKENIZER_REPO = "meta-llama/Llama-3.1-8B"
"""Every Llama 3.1 / 3.2 size shares this 128,256-id tokenizer."""
LLAMA3_TOKENIZER_DIR = str(ASSETS_DIR / "Llama-3.1-8B")
SMOKE_OVERRIDE = "--data.dataset embedded --tokenizer.path none"
"""A run that needs nothing downloaded: the embedded corpus and its own tokenizer."""
DATASET_CHECK_TIMEOUT_S = 10.0

TOKENIZER_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "config.json", "generation_config.json"]
"""Root-level files only: Llama 3's original/tokenizer.model (tiktoken) and original/*.pth stay behind."""
WEIGHT_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
_KNOWN_REPOS = {Path(repo).name: repo for repo in (
    LLAMA3_TOKENIZER_REPO, "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B")}
_TRUE = {"1", "on", "yes", "true"}


class HubAccessError(ValueError):
    """The hub refused or could not be reached; the message says why and what to do."""


def default_output(repo_id: str) -> Path:
    return ASSETS_DIR / repo_id.split("/")[-1]


def fetch_command(repo_id: str, output: str | os.PathLike | None = None, *, weights: bool = False) -> str:
    command = f"python scripts/download_hf_assets.py --repo {repo_id}"
    if output is not None and Path(output) != default_output(repo_id):
        command += f" --output {output}"
    return command + (" --weights" if weights else "")


def tokenizer_fetch_hint(path: str) -> str:
    """How to get the tokenizer ``tokenizer.path=path`` should name: the download command when the path ends
    in a known hub repository's default folder (assets/hf/<name>), and in any case the override for a smoke run."""
    repo = _KNOWN_REPOS.get(Path(path).name)
    if repo is not None and Path(path).parts[-3:] == default_output(repo).parts:
        fetch = (f"fetch it with `{fetch_command(repo, path)}` (a gated repository: accept the licence on "
                 f"https://huggingface.co/{repo} and pass your token with HF_TOKEN=... or --hf-token)")
    else:
        fetch = ("fetch a hub tokenizer with `python scripts/download_hf_assets.py --repo ORG/NAME --output "
                 f"{path}`, or train one with `python scripts/train_tokenizer.py --output tok.model`")
    return f"{fetch}; for a smoke run without downloads use `{SMOKE_OVERRIDE}`"


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) forbids network access, read now (not at import)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def download(repo_id: str, output: str | os.PathLike, *, weights: bool = False, token: str | None = None,
             snapshot_download: Callable[..., Any] | None = None) -> Path:
    """Fetch the tokenizer files (and with ``weights`` the safetensors) of ``repo_id`` into ``output``.

    ``snapshot_download`` defaults to huggingface_hub's; tests pass a local stand-in.
    """
    if hub_offline():
        raise HubAccessError(f"HF_HUB_OFFLINE is set, so {repo_id} cannot be fetched; unset HF_HUB_OFFLINE (and "
                             f"HF_DATASETS_OFFLINE) on a host with network access, or copy the folder here")
    if snapshot_download is None:
        import huggingface_hub

        snapshot_download = huggingface_hub.snapshot_download
    patterns = TOKENIZER_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        folder = snapshot_download(repo_id=repo_id, local_dir=str(output), allow_patterns=patterns, token=token)
    except Exception as error:  # huggingface_hub and its HTTP client raise many types; each is explained
        raise HubAccessError(explain_hub_error(error, repo_id, kind="model", token=token)) from error
    return Path(folder)


def check_hub_dataset(name: str, config_name: str | None, *, token: str | None = None,
                      timeout: float = DATASET_CHECK_TIMEOUT_S, api: Any = None) -> None:
    """Ask the hub whether dataset ``name`` (and its configuration) exists and this user may read it,
    reading metadata only. ``api`` defaults to ``huggingface_hub.HfApi()``."""
    if hub_offline():
        raise HubAccessError(
            f"data.dataset={name!r} is a Hugging Face hub dataset, but HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is "
            f"set: unset it on a host with network access, or use a local copy (data.dataset=<folder>), or for "
            f"a smoke run `{SMOKE_OVERRIDE}`")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    try:
        info = api.dataset_info(name, timeout=timeout, token=token)
    except Exception as error:  # see download()
        raise HubAccessError(explain_hub_error(error, name, kind="dataset", token=token, timeout=timeout)) from error
    configs = _dataset_configs(info)
    if config_name is not None and configs and config_name not in configs:
        raise HubAccessError(f"hub dataset {name!r} has no configuration data.dataset_config={config_name!r}; "
                             f"it has {sorted(configs)}")


def explain_hub_error(error: Exception, repo_id: str, *, kind: str, token: str | None,
                      timeout: float | None = None) -> str:
    """What went wrong talking to the hub about ``repo_id`` (a model or dataset), and the fix."""
    from huggingface_hub import errors

    page = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
    status = getattr(getattr(error, "response", None), "status_code", None)
    with_token = ("with the token given" if token else
                  "with the token in HF_TOKEN" if os.environ.get("HF_TOKEN") else "without a token")
    if isinstance(error, errors.GatedRepoError) or status == 403:
        return (f"{kind} {repo_id} is gated and cannot be read {with_token} (HTTP {status or 403}): "
                f"log in on {page}, accept the licence there (approval can take a while), then pass a read token "
                f"from https://huggingface.co/settings/tokens with HF_TOKEN=... or --hf-token")
    if isinstance(error, errors.RepositoryNotFoundError) or status in (401, 404):
        return (f"{kind} {repo_id} was not found {with_token} (HTTP {status}): check the name on {page}; "
                f"if it is gated or private, accept its licence there and pass a read token with HF_TOKEN=... "
                f"or --hf-token")
    waited = f" within {timeout:g}s" if timeout else ""
    offline = ("point data.dataset at a local copy (a folder of parquet/jsonl files)" if kind == "dataset"
               else "fetch the folder on a host with network access and copy it here")
    return (f"could not reach the Hugging Face hub for {kind} {repo_id}{waited} ({type(error).__name__}: {error}). "
            f"Check this host's network access to huggingface.co (proxy: HTTPS_PROXY; mirror: HF_ENDPOINT); without "
            f"network, {offline}; for a smoke run use `{SMOKE_OVERRIDE}`")


def _dataset_configs(info: Any) -> set[str]:
    """Configuration names a hub dataset declares in its card (empty when it declares none)."""
    card = getattr(info, "card_data", None) or {}
    declared = card.get("configs") if hasattr(card, "get") else None
    return {c["config_name"] for c in declared or [] if isinstance(c, dict) and "config_name" in c}
