"""Blockwise FP8 under tensor parallelism: one refusal before launch names every Linear and routed expert a TP
shard would cut, and its suggested filter keeps exactly those in high precision (applied, the check passes)."""
from __future__ import annotations

import re

import pytest
import torch

from config_registry import DEFAULT_REGISTRY
from torchtitan_lite.actions import run_action
from torchtitan_lite.config import parse_cli
from torchtitan_lite.protocols.tp_misfits import exact_filter_entries
from torchtitan_lite.resolved_run import resolve_run

CONFIG = "deepseek_v3_debug_fp8_blockwise"
# deepseek_v3 debug at tp=2: wo's input (128) and the shared and routed experts' hidden dim (128) leave 64 per
# shard; wq / wkv / the dense feed-forward keep whole 128-wide blocks.
CUT_LINEARS = {f"layers.{i}.attention.wo" for i in range(4)} | {
    f"layers.{i}.moe.shared_experts.{w}" for i in (1, 2, 3) for w in ("w1", "w2", "w3")}
CUT_EXPERTS = {f"layers.{i}.moe.experts.{w}" for i in (1, 2, 3) for w in ("w1", "w2", "w3")}


def _check(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    for name in ("WORLD_SIZE", "NGPU", "TORCHTITAN_LITE_PREFLIGHT", "TORCHTITAN_LITE_REQUIRE_DATA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC", "2")
    capsys.readouterr()
    status = run_action(parse_cli([*args, "--check-config"], registry=DEFAULT_REGISTRY), registry=DEFAULT_REGISTRY)
    out, err = capsys.readouterr()
    return status, out, err


def _high_precision(args: list[str], tp: int) -> tuple[set[str], set[str]]:
    """(Linears, expert weights) the run's converters keep in high precision by filter_fqns, at ``tp``."""
    cfg = parse_cli(args, registry=DEFAULT_REGISTRY).config
    cfg.parallelism.tp = tp
    run = resolve_run(cfg, world_size=tp, device_type="cpu")
    with torch.device("meta"):
        model = run.model_spec.model_cls(run.model_args)
    linears, experts = run.converters.converters
    return ({r.fqn for r in linears.plan_rows(model) if r.reason.startswith("filter_fqns entry")},  # type: ignore[attr-defined]
            {r.fqn for r in experts.plan_rows(model) if r.reason.startswith("filter_fqns entry")})  # type: ignore[attr-defined]


def test_one_refusal_names_every_cut_module_and_its_filter_keeps_exactly_those(monkeypatch, capsys, tmp_path):
    base = ["--config", CONFIG, "--parallelism.tp", "2", "--job.dump_folder", str(tmp_path / "run")]
    status, _, err = _check(base, monkeypatch, capsys)
    assert status == 2 and err.count("\n") == 1, err  # one error line, before any launch
    assert "parallelism.tp=2 would cut 22 module(s)" in err
    for group in ("layers.{0,1,2,3}.attention.wo", "layers.{1,2,3}.moe.shared_experts.w1",
                  "layers.{1,2,3}.moe.shared_experts.w2", "layers.{1,2,3}.moe.shared_experts.w3",
                  "layers.{1,2,3}.moe.experts.w1", "layers.{1,2,3}.moe.experts.w2", "layers.{1,2,3}.moe.experts.w3"):
        assert group in err, group
    assert "use parallelism.tp in [1]" in err
    flags = re.findall(r"(--model_converters\.converters\.\d\.filter_fqns) (\S+)", err)
    assert [flag for flag, _ in flags] == ["--model_converters.converters.0.filter_fqns",
                                           "--model_converters.converters.1.filter_fqns"]
    fixed = base + [word for pair in flags for word in pair]
    # The suggestion keeps the config's own entry (router.gate) and adds no bare name such as 'w1'.
    assert flags[0][1].split(",")[0] == "router.gate" and "w1" not in flags[0][1].split(",")
    # Exactly the cut modules leave FP8 (router.gate's gates aside): compare with the same run at tp=1.
    linears, experts = _high_precision(fixed, tp=1)
    before_linears, before_experts = _high_precision(base, tp=1)
    assert linears - before_linears == CUT_LINEARS
    assert experts - before_experts == CUT_EXPERTS
    status, out, err = _check(fixed, monkeypatch, capsys)
    assert status == 0, err
    assert f"config '{CONFIG}' is valid for 2 process(es) (TP 2)" in out


@pytest.mark.parametrize("action", ["--print-fp8-plan", "--estimate-memory", "--dry-run"])
def test_every_inspecting_action_refuses_with_every_converter_at_once(action, monkeypatch, capsys, tmp_path):
    for name in ("WORLD_SIZE", "NGPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC", "2")
    cli = parse_cli(["--config", CONFIG, "--parallelism.tp", "2", "--job.dump_folder", str(tmp_path / "run"),
                     action], registry=DEFAULT_REGISTRY)
    assert run_action(cli, registry=DEFAULT_REGISTRY) == 2
    err = capsys.readouterr().err
    assert "parallelism.tp=2 would cut 22 module(s)" in err
    assert "converters[float8_blockwise]: layers.{0,1,2,3}.attention.wo" in err
    assert "converters[moe_experts]: layers.{1,2,3}.moe.experts.w1" in err


@pytest.mark.parametrize("misfits, others, entries", [
    # Every block's wo: one entry for all of them.
    (["layers.0.attention.wo", "layers.1.attention.wo"], ["layers.0.attention.wq"], ("attention.wo",)),
    # Only block 1's shared w1, while every block's dense w1 and block 2's shared w1 work: the block's own name.
    (["layers.1.moe.shared_experts.w1"],
     ["layers.0.feed_forward.w1", "layers.2.moe.shared_experts.w1"], ("layers.1.moe.shared_experts.w1",)),
    # A short name inside a working one ('experts.w1' inside 'shared_experts.w1') is passed over.
    (["layers.1.moe.experts.w1"], ["layers.1.moe.shared_experts.w1"], ("moe.experts.w1",)),
])
def test_filter_entries_match_every_misfit_and_nothing_else(misfits, others, entries):
    got = exact_filter_entries(misfits, others)
    assert got == entries
    assert all(any(e in m for e in got) for m in misfits)
    assert not any(e in o for e in got for o in others)
