"""README's "Layout" section names every package of the tree, and no package that is gone."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _layout_block() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Layout")
    return text[text.index("```", start) + 3: text.index("```", text.index("```", start) + 3)]


def _named_packages(block: str) -> set[str]:
    """Folders as the block writes them: top level at column 0, sub-folders indented under their parent."""
    named, parent = set(), ""
    for line in block.splitlines():
        match = re.match(r"^( *)([\w/]+)/ ", line)
        if match is None:
            continue
        indent, name = match.groups()
        if indent:
            named.add(f"{parent}/{name}")
        else:
            parent = name
            named.add(name)
    return named


def test_the_layout_names_every_package_and_only_packages_that_exist():
    packages = {str(p.parent.relative_to(REPO)) for top in ("models", "torchtitan_lite", "config_registry")
                for p in (REPO / top).rglob("__init__.py")}
    # Tool sub-packages are the tools' own business; the layout names tools/ itself.
    packages = {p for p in packages if not p.startswith("torchtitan_lite/tools/")}
    named = _named_packages(_layout_block())
    assert packages - named == set(), "packages the README's Layout does not name"
    missing = {n for n in named if not (REPO / n).is_dir()}
    assert missing == set(), "folders the README's Layout names that do not exist"
