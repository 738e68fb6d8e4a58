"""Each registered config writes to its own folder, ./outputs/<config name>, unless a folder is named."""
from __future__ import annotations

import pytest

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.config import parse_cli
from torchtitan_lite.config.dump_folder import default_dump_folder, with_default_dump_folder
from torchtitan_lite.trainer import Trainer


def _dump_folder(*argv: str) -> str:
    return parse_cli(list(argv), registry=DEFAULT_REGISTRY).config.job.dump_folder


@pytest.mark.parametrize("name", ["llama3_debug", "qwen3_moe_debug", "deepseek_v3_debug", "llama3_debug_fp8"])
def test_each_config_has_its_own_default_folder(name):
    assert _dump_folder("--config", name) == f"./outputs/{name}" == default_dump_folder(name)


def test_the_default_config_writes_to_its_own_folder():
    assert _dump_folder() == "./outputs/llama3_debug"


def test_a_named_folder_is_kept_from_the_flag_the_file_or_the_config_function(tmp_path):
    assert _dump_folder("--config", "qwen3_moe_debug", "--job.dump_folder", "./outputs") == "./outputs"
    saved = tmp_path / "config.toml"
    saved.write_text(f'[job]\ndump_folder = "{tmp_path / "run"}"\n')
    assert _dump_folder("--config", "qwen3_moe_debug", "--config-file", str(saved)) == str(tmp_path / "run")
    own = Trainer.Config()
    own.job.dump_folder = "/data/runs/mine"
    assert with_default_dump_folder(own, "mine").job.dump_folder == "/data/runs/mine"


def test_help_shows_the_folder_of_the_config_it_is_given_with():
    assert DEFAULT_REGISTRY.get("deepseek_v3_debug").job.dump_folder == "./outputs/deepseek_v3_debug"
