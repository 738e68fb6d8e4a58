"""What each gpu_check stage measured, read from its outputs (log, junit report, JSON, markdown): a figure for
the report and whether it looks sound. A stage whose command failed is a failure whatever its figure says
(gpu_check.run_stage); a figure that cannot be read is one too."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

BENCH_CONFIGS = ("llama3_8b", "llama3_8b_fp8", "llama3_8b_fp8_rowwise")
"""Stage c's configs, the BF16 baseline first."""
HEAD_CONFIGS = ("llama3_8b_fp8", "llama3_8b_fp8_head")
"""Stage i's configs: FP8 tensorwise with the output head in BF16 (the baseline), then with the head in FP8 too."""
PP_GPUS = 2
"""GPUs the pipeline stages (f, g) need: one per pipeline rank."""
TARGET_SPEEDUPS = {"llama3_8b_fp8": 1.25, "llama3_8b_fp8_rowwise": 1.08, "qwen3_moe_30b_a3b_fp8": 1.0,
                   "qwen3_moe_30b_a3b_fp8_experts": 1.0}
"""Speed targets over BF16 on the stage's own proxy (reported, never enforced): FP8 tensorwise and rowwise on
the representative dense proxy, FP8 rowwise experts on the MoE one."""
TARGET_BF16_MFU = 40.0


def pytest_figure(out: Path, log: str) -> tuple[bool, str]:
    xml = out / "a_pytest.xml"
    if not xml.exists():
        return False, "no junit report (pytest did not run)"
    suites = ET.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    if suite is None:
        return False, "junit report without a test suite"
    total, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    passed = total - failed - errors - skipped
    text = f"{passed} passed, {failed} failed, {errors} errors, {skipped} skipped"
    # On a CUDA machine every test either runs or names why not (more GPUs); none passing means nothing ran.
    return passed > 0 and failed == 0 and errors == 0, text


def layer_bench_figure(out: Path, log: str) -> tuple[bool, str]:
    """The sum over the 8B Linears per recipe, from the JSON the bench rewrites after each shape (so a bench cut
    short still has a figure for what it measured), else from its final table."""
    path = out / "b_layers.json"
    if path.exists():
        rows = json.loads(path.read_text())["rows"]
        recipes = [k for k in rows[0]["seconds"] if k != "hp"] if rows else []
        parts = []
        for recipe in recipes:
            done = [r for r in rows if recipe in r["seconds"]]
            hp = sum(r["seconds"]["hp"] * r["count"] for r in done)
            fp8 = sum(r["seconds"][recipe] * r["count"] for r in done)
            parts.append(f"{recipe} {hp / fp8:.2f}x" + ("" if len(done) == len(rows) else f" ({len(done)} shapes)"))
        if parts:
            return True, f"sum of the 8B Linears ({len(rows)} shapes), FP8 over BF16: " + ", ".join(parts)
    header = next((line for line in log.splitlines() if line.startswith("| layer |")), None)
    total = next((line for line in log.splitlines() if line.startswith("| all (sum) |")), None)
    if header is None or total is None:
        measured = sum(line.startswith("measured ") for line in log.splitlines())
        return False, "no result table in the log" + (
            f"; {measured} 'measured ...' line(s) in it from before it stopped" if measured else "")
    names, cells = table_cells(header), table_cells(total)
    speedups = [f"{n.removesuffix(' speedup')} {c}" for n, c in zip(names, cells) if n.endswith(" speedup")]
    figure = "sum of the 8B Linears, FP8 over BF16: " + ", ".join(speedups)
    if "blockwise: blockwise GEMMs emulated" in log:   # float8_layer_bench's header: not torchao's kernels here
        figure += " (blockwise emulated on this GPU: not the kernels' speed)"
    return True, figure


def benchmark_figure(json_name: str) -> Callable[[Path, str], tuple[bool, str]]:
    """The figure of a scripts/benchmark.py stage, from the rows it wrote to ``json_name``."""
    return lambda out, log: benchmark_rows_figure(out / json_name)


def benchmark_rows_figure(path: Path) -> tuple[bool, str]:
    if not path.exists():
        return False, f"no benchmark rows (see {path.name.replace('.json', '.log')})"
    rows = {r["config"]: r for r in json.loads(path.read_text())["rows"]}
    return True, "; ".join(row_text(name, r) for name, r in rows.items()) + "; " + targets(rows)


def row_text(name: str, r: dict) -> str:
    mfu = "MFU n/a" if r["mfu_percent"] is None else f"MFU {r['mfu_percent']:.1f}%"
    compile_s = "" if r["compile_s"] is None else f", compile {r['compile_s']:.0f} s"
    return (f"{name}: {r['tokens_per_s_device']:,.0f} tok/s, {r['tflops_device']:.0f} TFLOP/s, {mfu}, "
            f"{r['peak_memory_gib']:.1f} GiB{compile_s}, {r['speedup']:.2f}x")


def head_figure(out: Path, log: str) -> tuple[bool, str]:
    """Stage i: both configs' rows and the step speedup of the FP8 head over the BF16 one. No speed target, and
    not the targets of stage c: llama3_8b_fp8 is this stage's baseline (1.00x by definition), not BF16's rival."""
    path = out / "i_benchmark.json"
    if not path.exists():
        return False, "no benchmark rows (see i_fp8_head.log)"
    rows = {r["config"]: r for r in json.loads(path.read_text())["rows"]}
    if missing := [name for name in HEAD_CONFIGS if name not in rows]:
        return False, f"no row for {', '.join(missing)} in {path.name}"
    speedup = rows[HEAD_CONFIGS[1]]["speedup"]
    return True, ("; ".join(row_text(name, rows[name]) for name in HEAD_CONFIGS)
                  + f"; the FP8 head makes the step {speedup:.3f}x as fast as the BF16 head")


def targets(rows: dict[str, dict]) -> str:
    """The speed targets, reported as met or missed (benchmarks are never pass/fail on speed)."""
    notes = []
    for name, target in TARGET_SPEEDUPS.items():
        if name in rows:
            met = "met" if rows[name]["speedup"] >= target else "MISSED"
            notes.append(f"target {name} >= {target}x: {met}")
    bf16_mfu = rows.get(BENCH_CONFIGS[0], {}).get("mfu_percent")
    if bf16_mfu is not None:
        notes.append(f"target BF16 MFU >= {TARGET_BF16_MFU:.0f}%: {'met' if bf16_mfu >= TARGET_BF16_MFU else 'MISSED'}")
    return ", ".join(notes) or "targets not evaluable"


def loss_figure(out: Path, log: str) -> tuple[bool, str]:
    """loss_compare's verdict lines: one seed (mean |gap| against the tolerance) or several (mean gap ± standard
    error against the baseline's seed-to-seed spread)."""
    band = re.search(r"noise band \(its seed-to-seed std\. dev\.\) ([0-9.]+)", log)
    seeds = re.findall(r"^\s+(\S+): mean gap ([-+0-9.]+ ± [0-9.]+) \(seeds ([^)]*)\) -> (.*)$", log, flags=re.M)
    if seeds and band:
        return True, "; ".join(f"{name} mean loss gap {gap} nats over seeds ({per_seed}), {verdict} "
                               f"(seed-to-seed spread {band.group(1)})" for name, gap, per_seed, verdict in seeds)
    gaps = re.findall(r"^\s+(\S+): mean \|gap\| ([0-9.]+).*-> (.*)$", log, flags=re.M)
    if not gaps:
        return False, "no loss gap in the log"
    return True, "; ".join(f"{name} mean |loss gap| {gap} nats ({verdict})" for name, gap, verdict in gaps)


def pp_train_figure(out: Path, log: str) -> tuple[bool, str]:
    losses = [(int(step), float(loss)) for step, loss in
              re.findall(r"step\s+(\d+)\s+loss\s+([-+0-9.naif]+)", re.sub(r"\x1b\[[0-9;]*m", "", log))]
    if not losses:
        return False, "no training loss in the log"
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    # A pipeline that trains: 20 steps at lr 3e-3 leave the first loss well behind (a NaN fails the comparison).
    sound = last < first
    return sound, f"PP {PP_GPUS} x 1F1B: loss {first:.4f} at step {first_step} -> {last:.4f} at step {last_step}"


def bubble_figure(out: Path, log: str) -> tuple[bool, str]:
    path = out / "g_pipeline_bubble.md"
    if not path.exists():
        return False, "no bubble table (see g_pipeline_bubble.log)"
    header, *rows = [table_cells(line) for line in path.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    parts = []
    for row in rows:
        cell = dict(zip(header, row, strict=True))
        parts.append(f"{cell['schedule']} idle {cell['mean']} (theory {cell['theory']}), step {cell['step ms']} ms")
    return bool(parts), "; ".join(parts) or "empty bubble table"


def table_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]
