"""The end-to-end speedup each FP8 recipe should reach, from a per-Linear bench and a profile of the BF16
step, beside the one measured; where the measured one falls short, where the time went.

    python -m torchtitan_lite.tools.fp8_expectation --layer-bench b_layers.json --e2e c_benchmark.json \\
        --profiles c_profiles --baseline llama3_8b --recipe llama3_8b_fp8=tensorwise \\
        --recipe llama3_8b_fp8_rowwise=rowwise --out-md c_expected.md --json-out c_expected.json

The arithmetic: the BF16 step spends ``t_s`` milliseconds in the GEMMs of Linear shape ``s`` (the profile's
block GEMMs whose dimensions are that Linear's {tokens, in, out}: forward, input gradient and weight
gradient alike). The layer bench measured the whole Linear, forward + backward with its casts, in BF16 and in
the recipe: speedup ``g_s``. A recipe converting the shapes ``S`` (the FP8 run's own list of converted
Linears) should therefore take

    expected step = BF16 step - sum over s in S of t_s (1 - 1 / g_s)

and reach ``BF16 step / expected step``. Everything else in the step (attention, the BF16 head and loss,
the optimizer, elementwise work) is assumed unchanged: a measured speedup under ``SHORTFALL`` x the expected
one means time went somewhere the bench does not see (casts that compile did not fuse, a slower GEMM in the
model than alone, another kernel), and the per-category table of both profiles shows where.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from torchtitan_lite.tools.step_profile import ProfileRecord, StepProfile, categorize, category_table

SHORTFALL = 0.9
"""Measured below this fraction of the expected speedup: the report shows the per-category profiles."""


@dataclass(frozen=True)
class LayerTiming:
    name: str
    m: int
    k: int
    n: int
    seconds: dict[str, float]
    """Median forward + backward seconds per variant; 'hp' is the high-precision Linear."""
    count: int = 1
    """Linears of this shape in a block."""

    def speedup(self, recipe: str) -> float | None:
        t = self.seconds.get(recipe)
        return self.seconds["hp"] / t if t else None

    @property
    def dims(self) -> tuple[int, int, int]:
        return tuple(sorted((self.m, self.k, self.n)))  # type: ignore[return-value]


@dataclass(frozen=True)
class Expectation:
    config: str
    recipe: str
    bf16_step_ms: float
    converted_gemm_ms: float
    """BF16 GEMM time per step in the Linears this config converts (matched to a bench shape)."""
    saved_ms: float
    expected_speedup: float
    measured_speedup: float | None
    unmatched: list[str]
    """Converted Linears (in x out) the bench or the profile has no time for: counted as unchanged."""

    @property
    def ratio(self) -> float | None:
        return None if self.measured_speedup is None else self.measured_speedup / self.expected_speedup

    @property
    def short(self) -> bool:
        return self.ratio is not None and self.ratio < SHORTFALL


def expect(config: str, recipe: str, *, bf16_step_ms: float, bf16_profile: StepProfile, layers: list[LayerTiming],
           converted: list[tuple[int, int]], measured_speedup: float | None) -> Expectation:
    """The expected end-to-end speedup of ``config`` (module docstring), with its measured one.

    Linears whose GEMMs share sorted dimensions (8B: w1/w3 are 4096 x 14336, w2 14336 x 4096, all three
    {8192, 4096, 14336}) share one profile entry: it is counted once, at their bench speedup together
    (BF16 time over FP8 time, each Linear as often as it occurs)."""
    by_dims: dict[tuple[int, int, int], list[LayerTiming]] = {}
    unmatched = []
    for k, n in converted:
        layer = next((lt for lt in layers if (lt.k, lt.n) == (k, n)), None)
        if layer is None or layer.speedup(recipe) is None or bf16_profile.gemm_ms.get(layer.dims, 0.0) == 0.0:
            unmatched.append(f"{k}x{n}")
            continue
        by_dims.setdefault(layer.dims, []).append(layer)
    gemm_ms, saved = 0.0, 0.0
    for dims, group in by_dims.items():
        speedup = sum(lt.seconds["hp"] * lt.count for lt in group) / sum(lt.seconds[recipe] * lt.count for lt in group)
        t = bf16_profile.gemm_ms[dims]
        gemm_ms += t
        saved += t * (1 - 1 / speedup)
    return Expectation(config, recipe, bf16_step_ms, gemm_ms, saved, bf16_step_ms / (bf16_step_ms - saved),
                       measured_speedup, unmatched)


def markdown(expectations: list[Expectation], profiles: dict[str, StepProfile], baseline: str) -> str:
    lines = ["| config | recipe | BF16 step ms | its converted GEMMs ms (share) | expected speedup | measured | "
             "measured / expected |", "|---|---|---:|---:|---:|---:|---:|"]
    for e in expectations:
        share = e.converted_gemm_ms / e.bf16_step_ms
        measured = "-" if e.measured_speedup is None else f"{e.measured_speedup:.3f}x"
        ratio = "-" if e.ratio is None else f"{e.ratio:.2f}" + (" **short**" if e.short else "")
        lines.append(f"| `{e.config}` | {e.recipe} | {e.bf16_step_ms:.1f} | {e.converted_gemm_ms:.1f} ({share:.1%}) | "
                     f"{e.expected_speedup:.3f}x | {measured} | {ratio} |")
    for e in expectations:
        if e.unmatched:
            lines.append(f"\n`{e.config}`: no bench or profile time for converted Linear(s) {', '.join(e.unmatched)} "
                         f"(counted as unchanged, so the expectation is low by their share)")
    short = [e.config for e in expectations if e.short and e.config in profiles]
    if short and baseline in profiles:
        lines += ["", f"Where the time went (per step, profiled), BF16 against the recipe(s) measured under "
                      f"{SHORTFALL} x their expected speedup:", "",
                  category_table({name: profiles[name] for name in (baseline, *short)})]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Files


def read_layers(path: Path) -> list[LayerTiming]:
    return [LayerTiming(r["name"], r["m"], r["k"], r["n"], r["seconds"], r.get("count", 1))
            for r in json.loads(path.read_text())["rows"]]


def read_profile(path: Path) -> tuple[StepProfile, list[tuple[int, int]]]:
    data = json.loads(path.read_text())
    records = [ProfileRecord.from_json(r) for r in data["records"]]
    profile = categorize(records, vocab_size=data["vocab_size"], steps=data["steps"])
    return profile, [(int(k), int(n)) for k, n in data["converted"]]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer-bench", type=Path, required=True, help="float8_layer_bench.py --json-out file")
    parser.add_argument("--e2e", type=Path, required=True, help="scripts/benchmark.py --json-out file")
    parser.add_argument("--profiles", type=Path, required=True, help="scripts/benchmark.py --profile-dir folder")
    parser.add_argument("--baseline", required=True, help="the BF16 config")
    parser.add_argument("--recipe", action="append", default=[], metavar="CONFIG=RECIPE",
                        help="an FP8 config and the layer bench recipe it uses (repeatable)")
    parser.add_argument("--out-md", type=Path)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if not args.recipe or any("=" not in r for r in args.recipe):
        parser.error("give each FP8 config as --recipe CONFIG=RECIPE (e.g. llama3_8b_fp8=tensorwise)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    layers = read_layers(args.layer_bench)
    rows = {r["config"]: r for r in json.loads(args.e2e.read_text())["rows"]}
    profiles, converted = {}, {}
    for name in [args.baseline, *(r.split("=", 1)[0] for r in args.recipe)]:
        path = args.profiles / f"{name}.json"
        if path.exists():
            profiles[name], converted[name] = read_profile(path)
    if args.baseline not in profiles or args.baseline not in rows:
        print(f"error: no profile or benchmark row of the baseline {args.baseline} in {args.profiles} / {args.e2e}",
              file=sys.stderr)
        return 2
    expectations = []
    for pair in args.recipe:
        config, recipe = pair.split("=", 1)
        if config not in converted:
            print(f"warning: no profile of {config} (its list of converted Linears); skipped", file=sys.stderr)
            continue
        measured = rows[config]["speedup"] if config in rows else None
        expectations.append(expect(config, recipe, bf16_step_ms=rows[args.baseline]["step_ms"],
                                   bf16_profile=profiles[args.baseline], layers=layers, converted=converted[config],
                                   measured_speedup=measured))
    text = markdown(expectations, profiles, args.baseline)
    print(text)
    if args.out_md:
        args.out_md.write_text(text)
    if args.json_out:
        args.json_out.write_text(json.dumps(
            {"expectations": [asdict(e) | {"ratio": e.ratio, "short": e.short} for e in expectations],
             "profiles_ms": {n: p.ms for n, p in profiles.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
