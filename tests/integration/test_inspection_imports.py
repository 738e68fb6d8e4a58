"""Inspection commands answer without loading what only training needs.

``--help``, ``--list-configs`` and ``--print-config`` read configs; importing torchao, datasets or
transformers (1-2 s each) or measuring the CPU's matmul peak would only make them slow.
"""
from __future__ import annotations

import json
import subprocess
import sys

from _cli import ROOT

HEAVY = ("torchao", "datasets", "transformers")

_PROBE = """
import contextlib, io, json, sys
sys.path.insert(0, {root!r})
import train
from torchtitan_lite.components import device_peaks
measured = []
device_peaks.measure_cpu_matmul_tflops = lambda *a, **k: measured.append(a) or 1.0
codes = []
for argv in ([ "--help"], ["--list-configs"], ["--print-config"], ["--print-config", "--config", "llama3_8b_fp8"]):
    with contextlib.redirect_stdout(io.StringIO()):
        codes.append(train.main(argv))
print(json.dumps({{"codes": codes, "measured": len(measured),
                  "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


def test_inspection_commands_import_no_training_libraries():
    probe = _PROBE.format(root=str(ROOT), heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 0, 0], "measured": 0, "heavy": []}
