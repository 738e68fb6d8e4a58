"""scripts/fp8_sqnr.py: ``--check`` runs the FP8 layer gates (fp8_gates.py), anything else measures a config's
per-layer SQNR (fp8_sqnr.py). Kept apart so that the gates can build on the measurement without the measurement
importing the gates."""
from __future__ import annotations

import logging
import sys

from torchtitan_lite.config.registry import ConfigRegistry
from torchtitan_lite.tools import fp8_gates, fp8_sqnr


def main(argv: list[str], *, registry: ConfigRegistry) -> int:
    args, _ = fp8_sqnr.parse_args(argv)
    if not args.check:
        return fp8_sqnr.main(argv, registry=registry)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torchtitan_lite.library_notices import silence_known_library_notices

    silence_known_library_notices()
    return check_gates(args.recipes, args.fault)


def check_gates(recipes: str | None, fault: str | None) -> int:
    """``--check``: the gate table and every failed gate; exit status 0 (all pass), 1 (a gate failed) or 2."""
    names = list(fp8_gates.RECIPES) if recipes is None else [r.strip() for r in recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in fp8_gates.RECIPES]
    if unknown:
        print(f"error: unknown FP8 recipe(s) {', '.join(unknown)}; choose from: {', '.join(fp8_gates.RECIPES)}",
              file=sys.stderr)
        return 2
    try:
        results, failures = fp8_gates.run_check(names, fault)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not results:
        print(f"error: fault {fault!r} applies to none of {', '.join(names)}", file=sys.stderr)
        return 2
    planted = f" with planted fault {fault}" if fault else ""
    print(f"FP8 layer gates{planted}: {len({r.recipe for r in results})} recipe(s), {len(results)} layers\n")
    print(fp8_gates.format_results(results))
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"\n{len(failures)} gate(s) failed" if failures else "\nevery gate passed")
    return 1 if failures else 0
