"""ModelConverter protocol and ModelConvertersContainer: registry, order, hooks, incompatible kinds."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch.nn as nn
from _conversion import context

from torchtitan_lite.components.quantization import Float8LinearConverter
from torchtitan_lite.protocols.model_converter import ModelConverter, ModelConvertersContainer


@pytest.fixture
def test_kinds():
    """Two converter kinds that exist only for the duration of a test."""
    calls: list[tuple[str, str]] = []

    class Recording(ModelConverter):
        @dataclass(kw_only=True)
        class Config(ModelConverter.Config):
            kind: ClassVar[str] = "test_recording"
            tag: str = ""
            """Label recorded with each call."""

        def convert(self, model):
            calls.append(("convert", self.config.tag))

        def post_optimizer_hook(self, model_parts):
            calls.append(("hook", f"{self.config.tag}:{len(model_parts)}"))

        def explain(self, model):
            return f"recording {self.config.tag}"

    class OtherLinearSwap(ModelConverter):
        @dataclass(kw_only=True)
        class Config(ModelConverter.Config):
            kind: ClassVar[str] = "test_linear_swap"
            swaps: ClassVar[str | None] = "nn.Linear"

    yield SimpleNamespace(Recording=Recording, OtherLinearSwap=OtherLinearSwap, calls=calls)
    for kind in ("test_recording", "test_linear_swap"):
        ModelConverter.Config._registry.pop(kind, None)


def test_registry_maps_kinds_to_config_classes(test_kinds):
    registry = ModelConverter.Config.registry()
    assert registry["float8"] is Float8LinearConverter.Config
    assert registry["test_recording"] is test_kinds.Recording.Config
    assert Float8LinearConverter.Config().kind == "float8"


def test_a_kind_cannot_be_registered_twice():
    with pytest.raises(TypeError, match="model converter kind 'float8' is already used by "
                                        "torchtitan_lite.components.quantization.float8.Float8LinearConverter.Config"):
        @dataclass(kw_only=True)
        class Clash(ModelConverter.Config):
            kind: ClassVar[str] = "float8"


def test_container_applies_converters_in_order_and_forwards_the_hook(test_kinds):
    config = ModelConvertersContainer.Config(converters=[test_kinds.Recording.Config(tag="a"),
                                                         test_kinds.Recording.Config(tag="b")])
    container = config.build(context=context())
    model = nn.Sequential(nn.Linear(4, 4))
    container.convert(model)
    container.post_optimizer_hook([model, model])
    assert test_kinds.calls == [("convert", "a"), ("convert", "b"), ("hook", "a:2"), ("hook", "b:2")]
    assert container.explain(model) == "recording a\n\nrecording b"


def test_empty_container_is_a_no_op():
    container = ModelConvertersContainer.Config().build(context=context())
    model = nn.Sequential(nn.Linear(4, 4))
    container.convert(model)
    container.post_optimizer_hook([model])
    assert type(model[0]) is nn.Linear
    assert container.explain(model) == "no model converters configured (model_converters.converters is empty)"


def test_two_float8_entries_are_rejected():
    with pytest.raises(ValueError, match=r"model_converters.converters\[0\] \(float8\) and \[1\] \(float8\) both "
                                         r"convert nn.Linear modules, and a module can be converted only once; "
                                         r"keep one of them"):
        ModelConvertersContainer.Config(converters=[Float8LinearConverter.Config(),
                                                    Float8LinearConverter.Config(recipe_name="rowwise")])


def test_float8_with_another_linear_swapping_kind_is_rejected_even_when_appended_later(test_kinds):
    config = ModelConvertersContainer.Config(converters=[test_kinds.Recording.Config(),
                                                         Float8LinearConverter.Config()])
    config.converters.append(test_kinds.OtherLinearSwap.Config())
    with pytest.raises(ValueError, match=r"converters\[1\] \(float8\) and \[2\] \(test_linear_swap\) both convert "
                                         r"nn.Linear modules"):
        config.build(context=context())


def test_an_entry_that_is_not_a_converter_config_is_rejected():
    with pytest.raises(ValueError, match=r"model_converters.converters\[0\] is a dict, not a converter config; "
                                         r"use one of: .*float8"):
        ModelConvertersContainer.Config(converters=[{"kind": "float8"}])


def test_print_after_conversion_logs_the_converted_model(caplog):
    config = ModelConvertersContainer.Config(converters=[Float8LinearConverter.Config()],
                                             print_after_conversion=True)
    container = config.build(context=context())
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        container.convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)))
    assert "model after conversion:\nSequential(\n  (0): Float8Linear(" in caplog.text
