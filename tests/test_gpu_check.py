"""``make gpu-check`` on a machine without CUDA: one line, exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: gpu-check would run the checks")
def test_gpu_check_without_cuda_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0]
