"""Without CUDA the GPU tests are collected and reported as skipped for that reason, never silently absent."""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU_TEST_FILES = ("test_gpu_float8.py", "test_gpu_flex_document_mask.py", "test_gpu_fsdp.py", "test_gpu_tp.py",
                  "test_gpu_checkpoint.py",
                  "test_gpu_grad_scaler.py", "test_gpu_memory_estimate.py", "test_gpu_profiler.py",
                  "test_gpu_moe_experts.py", "test_gpu_blockwise.py", "test_gpu_blockwise_experts.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour; on a GPU the tests run")
def test_pytest_m_gpu_skips_every_gpu_test_with_needs_cuda(tmp_path):
    report = tmp_path / "gpu.xml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider",
                             f"--junitxml={report}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    skips = {}
    for case in cases:
        skipped = case.find("skipped")
        assert skipped is not None, f"{case.get('name')} ran on a machine without CUDA"
        skips[(case.get("classname"), case.get("name"))] = skipped.get("message")
    assert set(skips.values()) == {"needs CUDA"}
    files = {classname.rsplit(".", 1)[-1] + ".py" for classname, _ in skips}
    assert files == set(GPU_TEST_FILES)
    # 3 + 2 + 1 float8, 2 FSDP, 1 TP, 1 DCP, 1 scaler, 4 memory cases, 1 profiler, 4 + 2 MoE grouped experts
    # (kernels, blockwise emulation), 1 + 1 blockwise, 3 blockwise experts against torchao's grouped blockwise GEMM.
    assert len(skips) == 32
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("32 skipped"), last
