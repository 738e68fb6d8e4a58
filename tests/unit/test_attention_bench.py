"""scripts/attention_bench.py: every kernel choice runs forward + backward, and the table says what each costs in
accuracy against a float64 reference."""
from functools import partial

import pytest

from models.common.attention.grouped_query import causal_attention
from torchtitan_lite.tools.attention_bench import main


def _rows(markdown: str) -> dict[str, tuple[float, float]]:
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1].replace(".", "").isdigit():
            rows[cells[0]] = (float(cells[1]), float(cells[2]))
    return rows


def test_each_choice_is_timed_and_its_error_measured(tmp_path):
    out = tmp_path / "attention.md"
    assert main(["--batch", "2", "--seq", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--warmup", "1",
                 "--repeats", "1", "--rounds", "1", "--out-md", str(out)],
                model_attention=partial(causal_attention, enable_gqa=True)) == 0
    text = out.read_text()
    assert "batch 2 x 4 heads (2 KV heads) x seq 32 x head_dim 16, bfloat16 activations" in text
    rows = _rows(text)
    assert list(rows) == ["sdpa", "sdpa in float32 (the model's CPU path)", "softmax(QK^T)V",
                          "softmax(QK^T)V, compiled"]
    assert all(ms > 0 for ms, _ in rows.values())
    # bfloat16 keeps 8 significant bits: one rounding of the output is at most 2^-8 = 3.9e-3 of its largest
    # magnitude; a few more roundings (scores, probabilities) stay well under 2e-2.
    assert all(err < 2e-2 for _, err in rows.values())
    # The model's path rounds only its output; the plain formula also rounds the scores and probabilities.
    assert rows["sdpa in float32 (the model's CPU path)"][1] <= rows["softmax(QK^T)V"][1]


def test_bad_shapes_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--heads", "6", "--kv-heads", "4"], model_attention=partial(causal_attention, enable_gqa=True))
    assert "--heads 6 must be a multiple of --kv-heads 4" in capsys.readouterr().err
