"""Each checkpoint holds the config it was trained with; the generation and export tools read that one."""
from __future__ import annotations

import importlib.util
import os

import pytest
from test_generation import save_run

import config_registry
from torchtitan_lite.components.checkpoint.layout import Marker
from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
from torchtitan_lite.components.checkpoint.verify import verify_step
from torchtitan_lite.config import apply_overrides, config_to_toml
from torchtitan_lite.config.overrides import Override
from torchtitan_lite.tools import generate as generate_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATE = ["--prompt", "def main(", "--max-new-tokens", "4"]


def _other_run_config(dump) -> None:
    """What a later run with --model.n_layers 3 in the same folder writes to <dump>/config.toml."""
    cfg = apply_overrides(config_registry.get("llama3_debug"), [Override("model.n_layers", 3, "test")])
    (dump / "config.toml").write_text(config_to_toml(cfg))


def test_the_checkpoint_holds_its_config_under_its_checksums(tmp_path):
    ckpt = save_run(tmp_path / "run", n_layers=1)
    saved = os.path.join(ckpt, "config.toml")
    assert open(saved).read() == (tmp_path / "run" / "config.toml").read_text()
    assert "config.toml" in Marker.read(ckpt).checksums
    with open(saved, "a") as f:
        f.write("\n# edited\n")
    assert verify_step(ckpt) == [f"{saved} is longer than written: "
                                 f"{os.path.getsize(saved)} bytes, {os.path.getsize(saved) - 10} were written"]


def test_generate_and_convert_read_the_checkpoints_config_after_the_folders_changed(tmp_path):
    dump = tmp_path / "run"
    ckpt = save_run(dump, n_layers=1)
    before = generate_tool.main(["--checkpoint", ckpt, *GENERATE], registry=config_registry.DEFAULT_REGISTRY)
    _other_run_config(dump)

    assert config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY).model.n_layers == 1
    after = generate_tool.main(["--checkpoint", ckpt, *GENERATE], registry=config_registry.DEFAULT_REGISTRY)
    assert after == before

    spec = importlib.util.spec_from_file_location("convert_to_hf", os.path.join(REPO, "scripts", "convert_to_hf.py"))
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    out = tmp_path / "hf"
    convert.main(["--checkpoint", ckpt, "--dtype", "float32", "--output", str(out)])
    assert (out / "config.toml").read_text() == open(os.path.join(ckpt, "config.toml")).read()
    assert config_for_checkpoint(str(out), registry=config_registry.DEFAULT_REGISTRY).model.n_layers == 1


def test_a_checkpoint_without_its_config_falls_back_to_the_runs(tmp_path):
    dump = tmp_path / "run"
    ckpt = save_run(dump, n_layers=1, config_in_checkpoint=False)
    assert not os.path.exists(os.path.join(ckpt, "config.toml"))
    assert config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY).model.n_layers == 1
    _other_run_config(dump)
    assert config_for_checkpoint(ckpt, registry=config_registry.DEFAULT_REGISTRY).model.n_layers == 3


@pytest.mark.parametrize("saved, now", [("true", "documents"), ("false", "none")])
def test_a_config_saved_when_data_shuffle_was_a_bool_still_reads_back(tmp_path, saved, now):
    from torchtitan_lite.components.checkpoint.run_config import load_config_file

    text = config_to_toml(config_registry.DEFAULT_REGISTRY.get("llama3_debug"))
    assert 'shuffle = "windows"' in text
    (tmp_path / "config.toml").write_text(text.replace('shuffle = "windows"', f"shuffle = {saved}"))
    config = load_config_file(tmp_path / "config.toml", registry=config_registry.DEFAULT_REGISTRY)
    assert config.data.shuffle == now
