"""``make gpu-check``: the GPU checks end to end (benchmarks/gpu_check.py); without CUDA
one line and exit status 2.

    python tools/gpu_check.py
"""

from __future__ import annotations

import sys

import _bootstrap  # noqa: F401  (first: environment and sys.path, see tools/_bootstrap.py)

try:
    from benchmarks.gpu_check import main, parse_args  # noqa: E402, F401  (parse_args: for tests/test_docs_commands.py)
except ModuleNotFoundError as exc:  # a GPU machine without network may lack what `make setup` installs
    sys.exit(f"gpu-check: the Python package '{exc.name}' is missing here: pip install it (offline: carry its "
             "wheel, see docs/performance.md, 'On a GPU')")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
