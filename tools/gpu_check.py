"""``make gpu-check``: the GPU checks end to end (benchmarks/gpu_check.py); without CUDA
one line and exit status 2.

    python tools/gpu_check.py
"""

from __future__ import annotations

import sys

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

from benchmarks.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
