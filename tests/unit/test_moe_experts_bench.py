"""scripts/moe_experts_bench.py: every row runs forward + backward on a tiny shape and lands in the table; a
torchtitan environment that cannot run says why in the table."""
import venv

import pytest

from tests.unit.test_hf_export_run import _script
from torchtitan_lite.tools.moe_experts_bench import SHAPES, bench_torchtitan, main, markdown, parse_args, routed_rows

TINY = ["--shapes", "debug", "--batch", "1", "--seq", "8", "--warmup", "0", "--repeats", "1"]


def _run(*extra: str, tmp_path) -> str:
    script = _script("moe_experts_bench")
    out = tmp_path / "moe.md"
    assert main([*TINY, *extra, "--out-md", str(out)], experts=script.build_experts, layer=script.build_layer,
                model=script.build_model) == 0
    return out.read_text()


def _rows(markdown: str) -> list[tuple[str, str, str, str, float]]:
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[4].replace(",", "").replace(".", "").isdigit():
            rows.append((*cells[:4], float(cells[4].replace(",", ""))))
    return rows


def test_each_case_is_timed_in_each_dtype(tmp_path):
    text = _run("--dtypes", "float32", "bfloat16", "--rounds", "2", tmp_path=tmp_path)
    assert "- debug: dim 128, expert hidden 128, 8 experts top-2, batch 1 x seq 8 = 8 tokens" in text
    assert "median of 1 forward + backward passes after 0 warmup, fastest of 2 round(s)" in text
    assert "load average" in text
    rows = _rows(text)
    expected = [(case, impl, "debug", dtype) for dtype in ("float32", "bfloat16")
                for case, impl in (("experts", "grouped"), ("experts", "loop"), ("MoE layer", "torchtitan_lite"),
                                   ("qwen3_moe debug model", "torchtitan_lite"))]
    assert [row[:4] for row in rows] == expected
    assert all(row[4] > 0 for row in rows)


def test_a_torchtitan_environment_that_fails_is_reported_with_its_error(tmp_path):
    # An environment without torch (nor torchtitan): its import error is what the table shows instead of rows.
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, symlinks=True)
    rows, error = bench_torchtitan(str(bare / "bin" / "python"), [SHAPES["debug"]], ["float32"], warmup=0, repeats=1)
    assert rows == [] and "No module named 'torch'" in error
    text = markdown([], [SHAPES["debug"]], error, parse_args([]))
    assert "torchtitan did not run:" in text and "No module named 'torch'" in text


def test_the_routing_fills_top_k_slots_per_token():
    shape = SHAPES["larger"]
    x, counts = routed_rows(shape)
    assert x.shape == (shape.tokens * shape.top_k, shape.dim)
    assert int(counts.sum()) == shape.tokens * shape.top_k and counts.shape == (shape.num_experts,)


@pytest.mark.parametrize(("argv", "message"), [(["--repeats", "0"], "--repeats 0"), (["--rounds", "0"], "--rounds 0"),
                                                   (["--seq", "0"], "--seq 0")])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(argv, experts=None, layer=None, model=None)
    assert message in capsys.readouterr().err
