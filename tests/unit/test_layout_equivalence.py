"""scripts/layout_equivalence.py's judgement: which layouts it trains, and when two runs count as equal."""
from __future__ import annotations

import torch

from torchtitan_lite.tools import layout_equivalence as eq


def test_expert_layouts_are_planned_only_for_families_with_experts():
    pairs = eq.planned(["llama3", "qwen3_moe"], list(eq.LAYOUTS))
    assert [layout for family, layout in pairs if family == "llama3"] == ["1", "fsdp2", "tp2", "pp2"]
    assert [layout for family, layout in pairs if family == "qwen3_moe"] == list(eq.LAYOUTS)
    assert eq.LAYOUTS["pp2_ep2"][0] == 4


def test_initial_states_are_equal_only_bitwise():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert eq.state_difference(a, {k: v.clone() for k, v in a.items()}) is None
    # One ulp in one element, another dtype with equal values, a missing key: each is a difference.
    nudged = {**a, "w": torch.tensor([1.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item(), 1.0])}
    assert eq.state_difference(a, nudged) == "1 tensors differ, first ['w']"
    assert eq.state_difference(a, {**a, "b": torch.zeros(2, dtype=torch.float64)}) == "1 tensors differ, first ['b']"
    assert eq.state_difference(a, {"w": a["w"]}) == "keys differ: ['b']"


def test_losses_compare_relatively_and_need_the_same_steps():
    base = {1: 2.0, 2: 4.0}
    assert eq.largest_relative_difference(dict(base), base) == 0.0
    assert abs(eq.largest_relative_difference({1: 2.0, 2: 4.0004}, base) - 1e-4) < 1e-12
    assert eq.largest_relative_difference({1: 2.0}, base) is None  # a step missing on one side
    assert eq.largest_relative_difference({}, {}) is None  # no losses logged is not "equal"


def test_the_planning_comparison_reads_the_documented_commands(tmp_path):
    from torchtitan_lite.tools.planning_equivalence import documented_commands, normalised

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Plan: `NGPU=64 ./run_train.sh --config a --parallelism.ep 8 --dry-run`.\n"
        "    ./run_train.sh --config b --estimate-memory\n"
        "A template is skipped: `NGPU=N ./run_train.sh --config <name> ... --dry-run`; training is not planning:\n"
        "    ./run_train.sh --config b\n")
    (tmp_path / "docs" / "x.md").write_text("again `./run_train.sh --config b --estimate-memory`\n")
    assert documented_commands(tmp_path) == [
        ({"NGPU": "64"}, ["--config", "a", "--parallelism.ep", "8", "--dry-run"]),
        ({}, ["--config", "b", "--estimate-memory"])]
    assert normalised("[rank0] 13:45:01 INFO models.x: 12:30 GiB, built in 0.4s") == \
        "[rank0] HH:MM:SS INFO <logger>: 12:30 GiB, built in Ns"


def test_a_revision_is_extracted_once_per_commit_it_names(tmp_path):
    # A name such as main~1 moves: what is kept (the tree, the baseline's runs and texts) goes by its commit.
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=eq.REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    commit, tree = eq.source_of("HEAD", tmp_path)
    assert commit == head and tree == tmp_path / head and (tree / "train.py").exists()
    (tree / "kept").write_text("")
    assert eq.source_of(f"{head}~0", tmp_path) == (head, tree) and (tree / "kept").exists()
