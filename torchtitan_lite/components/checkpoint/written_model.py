"""The model a checkpoint was written for, and the refusal to resume it as another model.

A checkpoint's ``step-N/config.toml`` names the family, flavor and n_layers of the run that wrote it, and
its DCP ``.metadata`` the rows of its embedding (the vocabulary its tokenizer grew the model to): together
they give the model arguments its weights have. A run whose own model differs cannot load them; unchecked,
it would build its model and then stop inside the load on the first tensor of another shape, with advice
about that tensor rather than about the folder. ``--check-config``, which run_train.sh runs before every
launch, refuses it instead, naming the model in the folder.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torchtitan_lite.components.checkpoint.layout import is_dcp_folder
from torchtitan_lite.components.checkpoint.run_config import find_run_config
from torchtitan_lite.components.checkpoint.verify import CheckpointError, read_metadata, saved_tensor_shape
from torchtitan_lite.config import ConfigError, apply_overrides, load_toml_overrides, overrides_from_dict
from torchtitan_lite.config.sections import ModelConfig
from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec


@dataclasses.dataclass(frozen=True)
class WrittenModel:
    """The model of a checkpoint, as its files record it."""

    family: str
    flavor: str
    args: Any | None
    """The family's model args for the flavor, with the checkpoint's n_layers and embedding rows; None when
    the family or flavor is not known to this version."""
    config_path: Path
    """The config.toml it was read from."""
    vocab_recorded: bool
    """Whether ``args.vocab_size`` is the checkpoint's own (its embedding rows were found)."""


def written_model(checkpoint_dir: str) -> WrittenModel | None:
    """What model ``checkpoint_dir`` holds; None when no config.toml records it (a checkpoint of a version
    that saved none: the load then judges it by its tensors alone)."""
    path = find_run_config(checkpoint_dir)
    if path is None:
        return None
    try:
        table = load_toml_overrides(str(path)).get("model", {})
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        model = apply_overrides(ModelConfig(), overrides_from_dict({k: v for k, v in table.items() if k in known},
                                                                   origin=str(path)))
    except ConfigError:
        return None
    try:
        spec = get_model_spec(model.name)
        rows = _embedding_rows(checkpoint_dir, f"model.{spec.parallel_plan.embedding}.weight")
        args = build_model_args(spec, model.flavor, n_layers=model.n_layers, vocab_size=rows)
    except ValueError:  # a family or flavor this version does not have
        return WrittenModel(model.name, model.flavor, None, path, vocab_recorded=False)
    return WrittenModel(model.name, model.flavor, args, path, vocab_recorded=rows is not None)


def check_same_model(written: WrittenModel, model: ModelConfig, args: Any, *, vocab_known: bool, step: int,
                     dump_folder: str) -> None:
    """A ValueError naming both models when the run's (``model``, resolved to ``args``) is not the one
    ``written`` records. ``vocab_known``: the run's vocabulary is its tokenizer's, not a plan made before the
    tokenizer exists (then the vocabulary is not compared)."""
    differing = _differing_args(written, args, vocab_known=vocab_known)
    if (written.family, written.flavor) == (model.name, model.flavor) and not differing:
        return
    why = " (the vocabulary follows the tokenizer, tokenizer.path)" if "vocab_size" in differing else ""
    raise ValueError(
        f"job.dump_folder={dump_folder} holds the checkpoint of step {step}, written by "
        f"{_describe(written.family, written.flavor, written.args, differing)} (recorded in {written.config_path}); "
        f"this run builds {_describe(model.name, model.flavor, args, differing)}{why}, which cannot load its weights. "
        f"Start this run in another folder with --job.dump_folder DIR, or resume that run with the configuration "
        f"that wrote it: --config-file {written.config_path}")


def _differing_args(written: WrittenModel, args: Any, *, vocab_known: bool) -> list[str]:
    if written.args is None or type(written.args) is not type(args):
        return []
    skipped = set() if vocab_known and written.vocab_recorded else {"vocab_size"}
    return [f.name for f in dataclasses.fields(args)
            if f.name not in skipped and getattr(written.args, f.name) != getattr(args, f.name)]


def _describe(family: str, flavor: str, args: Any, differing: list[str]) -> str:
    shown = ", ".join(f"{name}={getattr(args, name)}" for name in differing)
    return f"{family} flavor {flavor!r}" + (f" with {shown}" if shown else "")


def _embedding_rows(checkpoint_dir: str, key: str) -> int | None:
    """Rows of the checkpoint's embedding, from its metadata; None when that cannot be read (the load's own
    verification then explains the folder)."""
    if not is_dcp_folder(checkpoint_dir):
        return None
    try:
        shape = saved_tensor_shape(read_metadata(checkpoint_dir), key)
    except CheckpointError:
        return None
    return None if shape is None else shape[0]
