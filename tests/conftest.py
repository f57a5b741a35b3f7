"""Shared test fixtures: paths, the real-data folder, markers that skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests that import albumentations directly: no PyPI version check (detector.data sets the same).
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

ROOT = Path(__file__).resolve().parents[1]
REAL_DATA = ROOT.parent / "shared" / "data" / "real"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_real = pytest.mark.skip(reason=f"real data folder absent: {REAL_DATA}")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "realdata" in item.keywords and not REAL_DATA.is_dir():
            item.add_marker(skip_real)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def real_data() -> Path:
    if not REAL_DATA.is_dir():
        pytest.skip(f"real data folder absent: {REAL_DATA}")
    return REAL_DATA
