from dataclasses import dataclass, field

from test_config_toys import ScaleConfig, Schedule, ToyTrainer, Training

from torchtitan_lite.config.docs import field_docs, fields_help_text, undocumented_fields, walk_fields
from torchtitan_lite.config.field_types import config_fields


@dataclass(kw_only=True)
class PartlyDocumented:
    good: int = 1
    """Has a doc
    spread over two lines."""
    bare: int = 2
    also_bare: str = "x"
    # a comment is not a doc
    last: bool = False
    """Documented."""


@dataclass(kw_only=True)
class RootWithGaps:
    part: PartlyDocumented = field(default_factory=lambda: PartlyDocumented(good=5))
    """A section whose default comes from this factory."""
    undocumented_section: Training = field(default_factory=Training)


@dataclass(kw_only=True)
class FieldsAroundASection:
    first: int = 1
    """First."""
    schedule: Schedule = field(default_factory=Schedule)
    """Nested."""
    after: int = 2
    """Declared after the section."""


def test_every_toy_field_has_a_doc():
    assert undocumented_fields(ToyTrainer.Config) == []
    keys = [d.key for d in walk_fields(ToyTrainer.Config) if d.role != "kind"]
    assert "training.schedule.warmup" in keys and "model_converters.converters[quant].recipe_name" in keys
    n_fields = sum(1 for d in walk_fields(ToyTrainer.Config) if d.role != "kind")
    assert n_fields == 3 + len(config_fields(Training)) + 2 + 3 + 2 + 2 + 3  # root, sections, kinds


def test_docs_of_nested_config_class():
    assert field_docs(ToyTrainer.Config)["optimizer"] == "Optimizer."


def test_inherited_fields_keep_their_docs():
    assert field_docs(ScaleConfig) == {
        "enabled": "Whether this converter runs.", "factor": "Multiplier applied to the weights."}


def test_multiline_doc_is_cleaned():
    assert field_docs(PartlyDocumented)["good"] == "Has a doc\nspread over two lines."


def test_missing_docs_are_reported_by_dotted_key():
    assert undocumented_fields(RootWithGaps) == ["part.bare", "part.also_bare", "undocumented_section"]


def test_help_lines_show_type_default_and_doc():
    lines = fields_help_text(ToyTrainer.Config).splitlines()
    assert "[training]  Steps and batch." in lines
    assert "  --training.steps  int  (default: 10)  Optimizer steps." in lines
    assert "  --training.seed  int | None  (default: 0)  Random seed; None leaves RNGs unseeded." in lines
    assert "  --training.tag  str | None  (default: none)  Optional run tag." in lines
    assert "  --training.mode  {none,full,selective}  (default: 'none')  Recompute mode." in lines
    assert "  --training.components  list[str]  (default: [model, loss])  What to compile." in lines
    assert "  --training.schedule.ratio  float  (default: 0.5)  Fraction of the steps spent decaying." in lines
    assert "[training.schedule]  Learning-rate schedule." in lines


def test_help_lists_typed_list_kinds_and_their_fields():
    lines = fields_help_text(ToyTrainer.Config).splitlines()
    assert ("  --model_converters.converters  list[{scale,quant}]  (default: [])  Converters applied in order."
            in lines)
    assert "  --model_converters.converters quant  Quantize Linear layers." in lines
    assert ("  --model_converters.converters.N.recipe_name  {tensorwise,rowwise}  (default: 'tensorwise')  "
            "Scaling recipe.") in lines
    assert ("  --model_converters.converters.N.factor  float  (default: 2.0)  "
            "Multiplier applied to the weights.") in lines


def test_help_defaults_come_from_the_parent_default_factory():
    lines = fields_help_text(RootWithGaps).splitlines()
    assert "  --part.good  int  (default: 5)  Has a doc spread over two lines." in lines
    assert "  --part.bare  int  (default: 2)" in lines


def test_plain_fields_are_listed_before_sections():
    keys = [d.key for d in walk_fields(FieldsAroundASection)]
    assert keys == ["first", "after", "schedule", "schedule.warmup", "schedule.ratio"]
