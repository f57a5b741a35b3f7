"""``make gpu-check``: the GPU checks end to end (benchmarks/gpu_check.py); without CUDA
one line and exit status 2.

    python tools/gpu_check.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
