"""Hub assets without the network: scripts/download_hf_assets.py over a stand-in snapshot_download that
copies a local hub-style folder, hub errors explained (gated, not found, no network, offline), dataset
reachability through a stand-in HfApi, and the readiness check a launch runs first."""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from _hf_tokenizer import llama3_style_tokenizer, write_model_folder
from huggingface_hub import errors

from torchtitan_lite.components.data import TextDataLoader, readiness
from torchtitan_lite.components.data.readiness import DataNotReadyError, data_problems, require_data
from torchtitan_lite.components.tokenizer import Tokenizer
from torchtitan_lite.hf_assets import HubAccessError, check_hub_dataset, download

ROOT = Path(__file__).resolve().parents[2]
REPO = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory) -> Path:
    """A local stand-in of the hub repository: tokenizer files, weights and Llama 3's original/ folder."""
    repo = write_model_folder(tmp_path_factory.mktemp("hub") / "Llama-3.1-8B", llama3_style_tokenizer(400))
    (repo / "config.json").write_text(json.dumps({"vocab_size": 400}))
    (repo / "model-00001-of-00002.safetensors").write_bytes(b"w")
    (repo / "model.safetensors.index.json").write_text("{}")
    (repo / "original").mkdir()
    (repo / "original" / "tokenizer.model").write_text("IQ== 0\n")
    return repo


@pytest.fixture
def online(monkeypatch):
    """The code paths of a host with network access (the suite itself runs with HF_HUB_OFFLINE=1)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def _local_snapshot(hub_repo: Path, calls: list):
    def snapshot_download(*, repo_id, local_dir, allow_patterns, token):
        calls.append({"repo_id": repo_id, "token": token})
        for file in hub_repo.rglob("*"):
            relative = file.relative_to(hub_repo).as_posix()
            if file.is_file() and any(fnmatch.fnmatch(relative, p) for p in allow_patterns):
                (Path(local_dir) / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, Path(local_dir) / relative)
        return local_dir
    return snapshot_download


def _http_error(cls, status: int):
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(f"{status} Client Error", response=response)


def _script():
    spec = importlib.util.spec_from_file_location("download_hf_assets", ROOT / "scripts" / "download_hf_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_fetches_the_tokenizer_into_the_assets_folder_and_loads_it(hub_repo, tmp_path, monkeypatch, online,
                                                                          capsys):
    calls: list = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _local_snapshot(hub_repo, calls))
    monkeypatch.chdir(tmp_path)
    assert _script().main(["--repo", REPO, "--hf-token", "hf_x"]) == 0
    fetched = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "assets").rglob("*") if p.is_file())
    # Root-level tokenizer files only: no weights, and not the tiktoken original/tokenizer.model.
    assert fetched == ["assets/hf/Llama-3.1-8B/config.json", "assets/hf/Llama-3.1-8B/tokenizer.json",
                       "assets/hf/Llama-3.1-8B/tokenizer_config.json"]
    assert calls == [{"repo_id": REPO, "token": "hf_x"}]
    out = capsys.readouterr().out
    assert "tokenizer: assets/hf/Llama-3.1-8B/tokenizer.json (hf, vocabulary 400, bos=0 '<|begin_of_text|>', eos=1" in out
    assert "use it with --tokenizer.path assets/hf/Llama-3.1-8B" in out
    assert Tokenizer.Config(path="assets/hf/Llama-3.1-8B").build().vocab_size == 400


def test_script_with_weights_fetches_the_safetensors_and_prints_the_import_command(hub_repo, tmp_path, monkeypatch,
                                                                                   online, capsys):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _local_snapshot(hub_repo, []))
    assert _script().main(["--repo", REPO, "--output", str(tmp_path / "m"), "--weights"]) == 0
    assert (tmp_path / "m" / "model-00001-of-00002.safetensors").is_file()
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "m" / "original").exists()
    assert f"python scripts/convert_from_hf.py --hf-dir {tmp_path / 'm'} --config CONFIG" in capsys.readouterr().out


def test_gated_repository_explains_licence_and_token(tmp_path, monkeypatch, online, capsys):
    def gated(**kwargs):
        raise _http_error(errors.GatedRepoError, 403)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert _script().main(["--repo", REPO, "--output", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert ("error: model meta-llama/Llama-3.1-8B is gated and cannot be read without a token (HTTP 403): log in on "
            "https://huggingface.co/meta-llama/Llama-3.1-8B, accept the licence there") in err
    assert "pass a read token from https://huggingface.co/settings/tokens with HF_TOKEN=... or --hf-token" in err


@pytest.mark.parametrize("error, expected", [
    (lambda: _http_error(errors.RepositoryNotFoundError, 401),
     r"model meta-llama/Llama-3.1-8B was not found with the token given \(HTTP 401\): check the name .*accept its "
     r"licence there and pass a read token"),
    (lambda: ConnectionError("Name or service not known"),
     r"could not reach the Hugging Face hub for model meta-llama/Llama-3.1-8B \(ConnectionError: Name or service not "
     r"known\)\. Check this host's network access .*fetch the folder on a host with network access"),
])
def test_hub_failures_are_explained(tmp_path, online, error, expected):
    def failing(**kwargs):
        raise error()
    with pytest.raises(HubAccessError, match=expected):
        download(REPO, tmp_path, token="hf_x", snapshot_download=failing)


def test_offline_download_stops_before_asking_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubAccessError, match=r"HF_HUB_OFFLINE is set, so meta-llama/Llama-3.1-8B cannot be fetched"):
        download(REPO, tmp_path, snapshot_download=lambda **kw: pytest.fail("asked the hub while offline"))


class _Api:
    """HfApi.dataset_info stand-in: declares configurations like FineWeb-Edu's card, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []

    def dataset_info(self, name, *, timeout, token):
        self.calls.append((name, timeout))
        if self.error is not None:
            raise self.error
        return SimpleNamespace(card_data={"configs": [{"config_name": "default"}, {"config_name": "sample-10BT"}]})


def test_hub_dataset_check_reads_metadata_with_a_timeout(online):
    api = _Api()
    check_hub_dataset("HuggingFaceFW/fineweb-edu", "sample-10BT", timeout=3, api=api)
    assert api.calls == [("HuggingFaceFW/fineweb-edu", 3)]
    with pytest.raises(HubAccessError, match=r"has no configuration data.dataset_config='sample-10bt'; it has "
                                             r"\['default', 'sample-10BT'\]"):
        check_hub_dataset("HuggingFaceFW/fineweb-edu", "sample-10bt", api=api)


def test_hub_dataset_unreachable_names_network_and_the_smoke_override(online):
    api = _Api(TimeoutError("timed out"))
    with pytest.raises(HubAccessError, match=r"could not reach the Hugging Face hub for dataset HuggingFaceFW/fineweb-edu "
                                             r"within 10s \(TimeoutError: timed out\).*point data.dataset at a local copy"
                                             r".*`--data.dataset embedded --tokenizer.path none`"):
        check_hub_dataset("HuggingFaceFW/fineweb-edu", None, api=api)


def test_hub_dataset_offline_names_the_variable_without_asking():
    # The suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py).
    with pytest.raises(HubAccessError, match=r"data.dataset='HuggingFaceFW/fineweb-edu' is a Hugging Face hub dataset, "
                                             r"but HF_HUB_OFFLINE \(or HF_DATASETS_OFFLINE\) is set"):
        check_hub_dataset("HuggingFaceFW/fineweb-edu", None, api=_Api(AssertionError("asked the hub while offline")))


def test_readiness_lists_every_problem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = TextDataLoader.Config(dataset="HuggingFaceFW/fineweb-edu", dataset_config="sample-10BT", streaming=True,
                                 shuffle="none")
    problems = data_problems(data, Tokenizer.Config(path="assets/hf/Llama-3.1-8B"), validation=False)
    assert len(problems) == 2
    assert problems[0].startswith("tokenizer.path='assets/hf/Llama-3.1-8B' does not exist")
    assert "HF_HUB_OFFLINE" in problems[1]
    with pytest.raises(DataNotReadyError, match=r"the run's data is not ready:\n  - tokenizer.path=.*\n  - data.dataset="):
        require_data(data, Tokenizer.Config(path="assets/hf/Llama-3.1-8B"), validation=False)


def test_readiness_of_local_sources(tmp_path):
    ready = data_problems(TextDataLoader.Config(), Tokenizer.Config(), validation=True)
    missing = data_problems(TextDataLoader.Config(dataset=str(tmp_path / "*.jsonl"),
                                                  validation_files=str(tmp_path / "val.jsonl")),
                            Tokenizer.Config(), validation=True)
    offline_cached = data_problems(TextDataLoader.Config(dataset="org/cached-corpus"), Tokenizer.Config(),
                                   validation=False)
    assert ready == [] and offline_cached == []  # offline, a map-style hub dataset may be in the datasets cache
    assert missing == [f"data.dataset='{tmp_path}/*.jsonl' matches no files (relative paths resolve from "
                       f"{Path.cwd()}); check the path or glob"]


def test_only_local_rank_0_checks(monkeypatch):
    missing = TextDataLoader.Config(dataset="/no/such/file.jsonl")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DataNotReadyError, match=r"data.dataset='/no/such/file.jsonl'"):
        require_data(missing, Tokenizer.Config(), validation=False)
    # Another local rank returns without looking (rank 0 of its node reports for it).
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(readiness, "data_problems", lambda *a, **k: pytest.fail("local rank 1 checked the data"))
    assert require_data(missing, Tokenizer.Config(), validation=False) is None
