"""scripts/cp_attention_bench.py: a tiny run on 1 and 2 forked gloo ranks gives a row per degree whose
communication bytes, counted from the collectives' own tensors, equal (cp-1)/cp x S x W x element size; the
computed table is that formula at published shapes."""
from __future__ import annotations

import pytest

from models.common.attention.mask import build_mask
from torchtitan_lite.tools import cp_attention_bench as bench
from torchtitan_lite.tools import cp_attention_ranks as ranks

SETTINGS = ranks.Settings(seq_len=256, dtype="bfloat16", warmup=0, repeats=1)
CASES = [ranks.Case("gqa", "causal")]


def tiny_rows() -> list[bench.Row]:
    return bench.measure(SETTINGS, [1, 2], CASES, build_mask)


def test_tiny_run_counts_the_formulas_bytes_exactly():
    rows = tiny_rows()
    assert [(r.case, r.cp, r.tokens) for r in rows] == [(CASES[0], 1, 256), (CASES[0], 2, 128)]
    one, two = rows
    assert (one.gather_received, one.scatter_sent, one.formula) == (0, 0, 0)
    # 2 kv heads x head_dim 64 for k and v: W = 256; (2-1)/2 x 256 tokens x 256 x 2 bytes (bf16).
    assert two.formula == 65536
    assert (two.gather_received, two.scatter_sent) == (65536, 65536) and two.matches
    # cp=1 causal runs SDPA's is_causal: no mask; cp=2 attends with the layout's dense additive float32 mask.
    assert one.mask_mib == 0 and two.mask_mib == pytest.approx(128 * 256 * 4 / 2 ** 20)
    assert 0 < two.saved_mib < one.saved_mib and two.ms > 0
    table = "\n".join(bench.measured_table(rows))
    assert "| GQA | causal | 2 | 128 |" in table and "| 65,536 | 65,536 | 65,536 | yes |" in table


def test_counting_the_whole_gathered_tensor_as_received_is_caught(monkeypatch):
    # The planted bug: every gathered byte counted as received (S x W), this rank's own chunk included.
    # The ranks are forked, so they inherit the patch.
    monkeypatch.setattr(ranks, "received_bytes", lambda local, gathered: gathered.nbytes)
    two = tiny_rows()[1]
    assert two.gather_received == 2 * two.formula and not two.matches
    assert "**no**" in "\n".join(bench.measured_table([two]))


def test_computed_table_is_the_formula_at_published_shapes():
    layouts = {lay.name: lay for lay in bench.published_layouts()}
    l8b, l405b = layouts["llama3_8b"], layouts["Llama 3 405B"]
    assert (l8b.n_layers, l8b.width, l8b.cp) == (32, 2 * 8 * 128, 8)
    assert (l405b.n_layers, l405b.width, l405b.cp) == (126, 2 * 1 * 128, 16)
    per_collective = 15 * 131072 * 256 * 2 // 16
    assert bench.formula_bytes(131072, 16, 256, 2) == per_collective
    rows = bench.computed_table([l405b])
    assert rows[-1].endswith(f"| {126 * 2 * per_collective / 2 ** 30:.1f} | {126 * 3 * per_collective / 2 ** 30:.1f} |")
